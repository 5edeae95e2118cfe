//! The decode ops in the form a decode arena runs them: each writes its result into a buffer
//! the caller gives instead of allocating one, and computes what its allocating form computes.
//!
//! A CUDA graph captured over allocating ops holds a memory node for every output, which keeps
//! the driver from updating the graph and orders every kernel behind an allocation. Over these
//! ops a decode body is kernels and cuBLAS calls only. On CUDA they call the kernels with the
//! output pointer given (`cuda::*_into`); elsewhere they run the allocating op (its reference)
//! and copy the result into the buffer, so the arena's plumbing — which buffer holds what, when
//! one is overwritten — is checked on the CPU against the plain body, bit for bit.
//!
//! No output may alias an input of the same op.

use super::{PagedBatch, RopeAngles};
use candle_core::{DType, Device, Result, Tensor};

/// Copies `value` into `out` (same element count; `out` contiguous).
pub(crate) fn copy_into(out: &Tensor, value: &Tensor) -> Result<()> {
    if out.elem_count() != value.elem_count() {
        candle_core::bail!("into: a result of {:?} into a buffer of {:?}", value.dims(), out.dims());
    }
    out.slice_set(&value.contiguous()?.reshape(out.shape())?, 0, 0)
}

/// `out = x · wᵀ` (`x` `[rows, k]`, `w` `[n, k]`, `out` `[rows, n]` of `x`'s dtype): the product
/// the dense `Linear::forward` (no bias) computes.
pub fn linear_into(x: &Tensor, w: &Tensor, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && super::is_float(x.dtype()) {
        return super::cuda::linear_into(x, w, out);
    }
    copy_into(out, &x.matmul(&w.t()?)?)
}

/// `out = x · wᵀ` in f32 (`out` `[rows, n]` f32): the looped heads' logits
/// ([`super::linear_f32`]), on CUDA straight into `out` (one GEMM storing f32).
pub fn linear_f32_into(x: &Tensor, w: &Tensor, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16) && x.rank() == 2 {
        return super::cuda::linear_partials_into(x, w, 1, out);
    }
    copy_into(out, &super::linear_f32(x, w)?)
}

/// An exit gate's logit per row: `out = (f32(h) · wᵀ + bias)` squeezed to `[rows]` (`w` `[1, k]`,
/// `bias` `[1]`, f32), the value of the gate's `Linear::forward` over `h` cast to f32. On CUDA one
/// launch with the cast folded into the load (its sum in another order than cuBLAS's, so a
/// last-bit difference from the plain body's gate is possible there); elsewhere that composition.
pub fn gate_logit_into(h: &Tensor, w: &Tensor, bias: &Tensor, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if h.device().is_cuda() && super::is_float(h.dtype()) {
        return super::cuda::row_dot_f32_into(h, w, bias, out);
    }
    let logit = h.to_dtype(DType::F32)?.matmul(&w.t()?)?.broadcast_add(bias)?;
    copy_into(out, &logit)
}

/// A core step's relative latent change per row, `‖new − old‖ / ‖new‖` over the first `cols`
/// columns of `old` and `new` (`[rows, width]`; a looped state's s half), written into `out`
/// (`[rows]` f32). On CUDA one launch; elsewhere [`super::fused::latent_change_reference`].
pub fn latent_change_into(old: &Tensor, new: &Tensor, cols: usize, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if new.device().is_cuda() && super::is_float(new.dtype()) && new.rank() == 2 {
        return super::cuda::latent_change_into(old, new, cols, out);
    }
    copy_into(out, &super::fused::latent_change_reference(old, new, cols)?)
}

/// Rows `index[r]` of `src` `[src_rows, width]` into `out` `[rows, width]` (`index_select`).
pub fn gather_rows_into(src: &Tensor, index: &Tensor, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if src.device().is_cuda() && super::is_float(src.dtype()) {
        return super::cuda::gather_rows_into(src, index, out);
    }
    copy_into(out, &src.index_select(index, 0)?)
}

/// [`gather_rows_into`] times `scale`: `index_select(src, index) * scale` (Huginn's scaled
/// embedding rows), rounded as candle's affine rounds it on each device.
pub fn gather_rows_scaled_into(src: &Tensor, index: &Tensor, scale: f64, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if src.device().is_cuda() && super::is_float(src.dtype()) {
        return super::cuda::gather_rows_scaled_into(src, index, scale, out);
    }
    copy_into(out, &(src.index_select(index, 0)? * scale)?)
}

/// `src` (`[rows, w]`, contiguous) into columns `col .. col + w` of `dst` (`[rows, W]`,
/// contiguous): a loop state's half (Huginn's `[s | e]`). One strided copy, nothing allocated.
pub fn write_columns(dst: &Tensor, col: usize, src: &Tensor) -> Result<()> {
    dst.slice_set(src, 1, col)
}

/// The greedy ids of `logits` and the same ids flagged ([`super::greedy_ids_flagged`]) written
/// into `ids` and `flagged` (`[rows]` u32).
pub fn greedy_ids_flagged_into(logits: &Tensor, vocab: usize, ids: &Tensor, flagged: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() && super::is_float(logits.dtype()) && logits.rank() == 2 {
        if let Ok(flag) = u32::try_from(vocab) {
            return super::cuda::greedy_flagged_into(logits, flag, ids, flagged);
        }
    }
    let (i, f) = super::greedy_ids_flagged(logits, vocab)?;
    copy_into(ids, &i)?;
    copy_into(flagged, &f)
}

/// `out = rms_norm(x, w)` ([`super::rms_norm`]).
pub fn rms_norm_into(x: &Tensor, w: &Tensor, eps: f64, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && super::is_float(x.dtype()) && w.dtype() == x.dtype() {
        return super::cuda::rms_norm_into(x, w, eps as f32, out);
    }
    copy_into(out, &super::rms_norm(x, w, eps)?)
}

/// `(h, n)` of [`super::add_rms_norm`] written into `h` and `n`.
pub fn add_rms_norm_into(residual: &Tensor, x: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f64, h: &Tensor, n: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && super::is_float(x.dtype()) && [residual, w_x, w_next].iter().all(|t| t.dtype() == x.dtype()) {
        return super::cuda::add_rms_norm_into(residual, x, w_x, w_next, eps as f32, h, n);
    }
    let (hv, nv) = super::add_rms_norm(residual, x, w_x, w_next, eps)?;
    copy_into(h, &hv)?;
    copy_into(n, &nv)
}

/// `(h, n)` of [`super::residual_add_rms_norm`] written into `h` and `n`.
pub fn residual_add_rms_norm_into(residual: &Tensor, x: &Tensor, w: &Tensor, eps: f64, h: &Tensor, n: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && super::is_float(x.dtype()) && [residual, w].iter().all(|t| t.dtype() == x.dtype()) {
        return super::cuda::residual_add_rms_norm_into(residual, x, w, eps as f32, h, n);
    }
    let (hv, nv) = super::residual_add_rms_norm(residual, x, w, eps)?;
    copy_into(h, &hv)?;
    copy_into(n, &nv)
}

/// A residual stream normalised after each add, and the norm that reads it next:
/// `h = rms_norm(residual + x, w)`, `n = rms_norm(h, w_next)` written into `h` and `n` — what
/// [`super::residual_add_rms_norm`] (its norm taken as `h`) and then [`super::rms_norm`] give,
/// in one launch on CUDA.
pub fn post_norm_into(residual: &Tensor, x: &Tensor, (w, w_next): (&Tensor, &Tensor), eps: f64, h: &Tensor, n: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && super::is_float(x.dtype()) && [residual, w, w_next].iter().all(|t| t.dtype() == x.dtype()) {
        return super::cuda::post_norm_into(residual, x, w, w_next, eps as f32, h, n);
    }
    let (_, hv) = super::residual_add_rms_norm(residual, x, w, eps)?;
    copy_into(h, &hv)?;
    copy_into(n, &super::rms_norm(&hv, w_next, eps)?)
}

/// `out = silu(gate) * up` ([`super::silu_mul`]).
pub fn silu_mul_into(gate_up: &Tensor, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if gate_up.device().is_cuda() && super::is_float(gate_up.dtype()) {
        return super::cuda::silu_mul_into(gate_up, out);
    }
    copy_into(out, &super::silu_mul(gate_up)?)
}

/// The pair of row norms that follows a decode projection (`x · wᵀ`), the projection's output
/// `p`: each writes the residual stream `h` and the next op's input `n`. On CUDA, with `p`
/// given as split-k partials, one kernel sums them and runs the pair.
#[derive(Debug, Clone, Copy)]
pub enum NormAfter<'a> {
    /// `h = residual + rms_norm(p, w_x)`, `n = rms_norm(h, w_next)` (Ouro's sandwich,
    /// [`add_rms_norm_into`]).
    Sandwich { w_x: &'a Tensor, w_next: &'a Tensor },
    /// `h = residual + p`, `n = rms_norm(h, w)` (the pre-norm residual step,
    /// [`residual_add_rms_norm_into`]).
    PreNorm { w: &'a Tensor },
    /// `h = rms_norm(residual + p, w)`, `n = rms_norm(h, w_next)` (Huginn's sandwich,
    /// [`post_norm_into`]).
    PostNorm { w: &'a Tensor, w_next: &'a Tensor },
}

/// A decode projection and the norms after it, written into `h` and `n`: split over k as
/// [`super::linear_add_rms_norm`] splits it, its partial products in `parts` (f32, flat; a
/// split that needs more than it holds allocates) summed by the norm's kernel, or whole through
/// `proj` (`[rows, n]`).
#[allow(clippy::too_many_arguments)]
pub fn linear_norm_into(
    residual: &Tensor,
    x: &Tensor,
    w: &Tensor,
    norm: NormAfter,
    eps: f64,
    (proj, parts): (&Tensor, &Tensor),
    h: &Tensor,
    n: &Tensor,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(parts) = split_partials(x, w, parts)? {
        return super::cuda::norm_of_partials_into(residual, &parts, norm, eps as f32, h, n);
    }
    let _ = parts;
    linear_into(x, w, proj)?;
    match norm {
        NormAfter::Sandwich { w_x, w_next } => add_rms_norm_into(residual, proj, w_x, w_next, eps, h, n),
        NormAfter::PreNorm { w } => residual_add_rms_norm_into(residual, proj, w, eps, h, n),
        NormAfter::PostNorm { w, w_next } => post_norm_into(residual, proj, (w, w_next), eps, h, n),
    }
}

/// Where `split_k_plan` splits `x · wᵀ` over k (only on CUDA): its partial products
/// `[splits, rows, n]`, in `parts` where that holds them, else in a new tensor; `None` where
/// the projection runs whole.
#[cfg(feature = "cuda")]
fn split_partials(x: &Tensor, w: &Tensor, parts: &Tensor) -> Result<Option<Tensor>> {
    let Some(splits) = super::split_k::split_k_plan(x, w.dim(0)?) else {
        return Ok(None);
    };
    let (rows, cols) = (x.dim(0)?, w.dim(0)?);
    let len = splits * rows * cols;
    if parts.elem_count() < len {
        return super::cuda::linear_partials(x, w, splits).map(Some);
    }
    let p = parts.narrow(0, 0, len)?.reshape((splits, rows, cols))?;
    super::cuda::linear_partials_into(x, w, splits, &p)?;
    Ok(Some(p))
}

/// Decode attention's own buffers in a decode arena: the split partials' workspace (f32 `acc`
/// and `ml`, u32 `own`, sized for the decode ring at the arena's width) and, for launches the
/// folded kernels do not take (GQA groups), the rotated q between the two launches. Empty off
/// CUDA, where attention allocates nothing of its own.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct AttentionScratch {
    acc: Tensor,
    ml: Tensor,
    own: Tensor,
    q: Tensor,
}

impl AttentionScratch {
    pub fn new(rows: usize, heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        #[allow(unused_mut)]
        let mut len = [0usize; 4];
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            let [acc, ml, own] = super::cuda::attention_scratch_len(dev, rows, heads, head_dim)?;
            len = [acc, ml, own, rows * heads * head_dim];
        }
        let _ = (rows, heads, head_dim);
        Ok(Self {
            acc: Tensor::zeros(len[0], DType::F32, device)?,
            ml: Tensor::zeros(len[1], DType::F32, device)?,
            own: Tensor::zeros(len[2], DType::U32, device)?,
            q: Tensor::zeros(len[3], dtype, device)?,
        })
    }
}

#[cfg(feature = "cuda")]
impl AttentionScratch {
    /// The rotated q's buffer `[T, heads, head_dim]` for `qkv`'s `T` rows, where it holds them.
    fn q_for(&self, qkv: &Tensor, heads: usize, head_dim: usize) -> Result<Option<Tensor>> {
        let t = qkv.dim(0)?;
        if self.q.dtype() != qkv.dtype() || self.q.elem_count() < t * heads * head_dim {
            return Ok(None);
        }
        Ok(Some(self.q.narrow(0, 0, t * heads * head_dim)?.reshape((t, heads, head_dim))?))
    }

    /// Paged attention of the rotated `q` into `out`, the split workspace this one.
    fn attend_into(&self, q: &Tensor, (k_cache, v_cache): (&Tensor, &Tensor), batch: &PagedBatch, scale: f64, out: &Tensor) -> Result<()> {
        let into = super::cuda::AttentionInto { out, acc: &self.acc, ml: &self.ml, own: &self.own };
        let tables = [&batch.block_tables, &batch.context_lens, &batch.cu_q_lens];
        super::cuda::paged_attention_into(q, k_cache, v_cache, tables, batch.max_q_len, batch.max_context_len, scale as f32, batch.mask.block(), &into)
    }
}

/// [`super::qkv_rope_attention`] written into `out` (`[T, heads, head_dim]`, contiguous): on CUDA
/// the folded decode kernels with the output and `scratch` given; where they do not take the
/// launch, the two ops and a copy.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_attention_into(
    qkv: &Tensor,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    scale: f64,
    scratch: &AttentionScratch,
    out: &Tensor,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        let into = super::cuda::AttentionInto { out, acc: &scratch.acc, ml: &scratch.ml, own: &scratch.own };
        if super::fused::folded_decode_attention(qkv, angles, (k_cache, v_cache), batch, (heads, kv_heads), scale, Some(&into))?.is_some() {
            return Ok(());
        }
        // The two launches the plain op runs where its `qkv_rope_write` takes the CUDA kernel,
        // q in the arena between them.
        if super::fused::rope_write_kernel_takes(qkv, angles, k_cache, v_cache) {
            if let Some(q) = scratch.q_for(qkv, heads, head_dim)? {
                let (cos, sin, slots) = (&angles.cos, &angles.sin, &batch.slot_mapping);
                super::cuda::qkv_rope_write_into(&qkv.contiguous()?, cos, sin, k_cache, v_cache, slots, (heads, kv_heads, head_dim), &q)?;
                return scratch.attend_into(&q, (k_cache, v_cache), batch, scale, out);
            }
        }
    }
    let _ = scratch;
    copy_into(out, &super::qkv_rope_attention(qkv, angles, k_cache, v_cache, batch, heads, kv_heads, head_dim, scale)?)
}

/// [`super::qkv_bias_rope_i_write`] then [`super::paged_attention`] (Huginn's attention), the
/// attention written into `out` (`[T, heads, head_dim]`, contiguous): on CUDA the two kernels
/// with q in `scratch` between them and the split workspace given; elsewhere the two ops and a
/// copy.
#[allow(clippy::too_many_arguments)]
pub fn qkv_bias_rope_i_attention_into(
    qkv: &Tensor,
    bias: Option<(&Tensor, &Tensor)>,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    scale: f64,
    scratch: &AttentionScratch,
    out: &Tensor,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if super::fused::bias_rope_kernel_takes(qkv, bias, angles, k_cache, v_cache) {
        if let Some(q) = scratch.q_for(qkv, heads, head_dim)? {
            let (cos, sin, slots) = (&angles.cos, &angles.sin, &batch.slot_mapping);
            super::cuda::qkv_bias_rope_i_write(&qkv.contiguous()?, bias, cos, sin, k_cache, v_cache, slots, (heads, kv_heads, head_dim), Some(&q))?;
            return scratch.attend_into(&q, (k_cache, v_cache), batch, scale, out);
        }
    }
    let _ = scratch;
    let q = super::qkv_bias_rope_i_write(qkv, bias, angles, k_cache, v_cache, batch, heads, kv_heads, head_dim)?;
    copy_into(out, &super::paged_attention(&q, k_cache, v_cache, batch, scale)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer of the wrong size is an error of that op, never a panic or a partial write.
    #[test]
    fn a_buffer_of_the_wrong_size_is_an_error() {
        let dev = Device::Cpu;
        let x = Tensor::ones((3, 8), DType::F32, &dev).unwrap();
        let w = Tensor::ones((5, 8), DType::F32, &dev).unwrap();
        let small = Tensor::full(7f32, (2, 5), &dev).unwrap();
        assert!(linear_into(&x, &w, &small).is_err());
        assert_eq!(small.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![7.0; 10], "nothing written");
        let out = Tensor::zeros((3, 5), DType::F32, &dev).unwrap();
        linear_into(&x, &w, &out).unwrap();
        assert_eq!(out.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![8.0; 15]);
        let idx = Tensor::new(&[2u32, 0], &dev).unwrap();
        assert!(gather_rows_into(&x, &idx, &Tensor::zeros((3, 8), DType::F32, &dev).unwrap()).is_err());
        let gathered = Tensor::zeros((2, 8), DType::F32, &dev).unwrap();
        gather_rows_into(&x, &idx, &gathered).unwrap();
        assert!(gather_rows_into(&x, &Tensor::new(&[9u32], &dev).unwrap(), &gathered.narrow(0, 0, 1).unwrap()).is_err(), "an index past the rows");
    }
}
