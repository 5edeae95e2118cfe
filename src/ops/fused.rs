//! Fused per-layer ops. At decode widths a layer's cost is the number of launches, not the work,
//! so the chains of small ops around the matmuls run as one kernel each on CUDA
//! (`src/ops/kernels/fused.cu`). Each op has one entry point that dispatches on the device:
//! elsewhere (and for layouts the kernels do not take) it runs the composition of candle ops the
//! models used before, which is also the reference the kernels are tested against.

use super::{rms_norm, write_kv, PagedBatch, RopeAngles};
use candle_core::{DType, Result, Tensor, D};

/// Splits the fused QKV projection `qkv` `[T, (heads + 2*kv_heads) * head_dim]` (q, k, v side by
/// side), applies split-half RoPE to q and k, writes the rotated k and v into `k_cache` /
/// `v_cache` (`[num_blocks, block_size, kv_heads, head_dim]`) in place at `batch.slot_mapping`,
/// and returns the rotated q `[T, heads, head_dim]` (contiguous).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_write(
    qkv: &Tensor,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if rope_write_kernel_takes(qkv, angles, k_cache, v_cache) {
        return super::cuda::qkv_rope_write(&qkv.contiguous()?, &angles.cos, &angles.sin, k_cache, v_cache, &batch.slot_mapping, heads, kv_heads, head_dim);
    }
    qkv_rope_write_reference(qkv, angles, k_cache, v_cache, batch, heads, kv_heads, head_dim)
}

/// Whether [`qkv_rope_write`] runs the CUDA kernel: on CUDA, a float dtype shared by every
/// tensor, the angles and caches contiguous.
#[cfg(feature = "cuda")]
pub(crate) fn rope_write_kernel_takes(qkv: &Tensor, angles: &RopeAngles, k_cache: &Tensor, v_cache: &Tensor) -> bool {
    let dt = qkv.dtype();
    qkv.device().is_cuda() && super::is_float(dt) && [&angles.cos, &angles.sin, k_cache, v_cache].iter().all(|t| t.dtype() == dt && t.is_contiguous())
}

/// [`qkv_rope_write`] then [`paged_attention`](super::paged_attention) of the rotated q, for any
/// launch: returns the attention output `[T, heads, head_dim]`, with the rotated k and v written
/// into the caches as [`qkv_rope_write`] writes them. On CUDA one kernel does both
/// (`cuda::qkv_rope_paged_attention`: the same cache writes, the same output up to the softmax's
/// rounding) where the batch's write positions are implicit — one token a row, so its slot is its
/// context's last ([`PagedBatchHost::row_positions`]) — and either the decode ring takes the
/// launch or it is an MHA decode launch the one-query SIMT kernel takes; elsewhere the two ops in
/// turn.
///
/// [`PagedBatchHost::row_positions`]: super::PagedBatchHost::row_positions
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_attention(
    qkv: &Tensor,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(out) = folded_decode_attention(qkv, angles, (k_cache, v_cache), batch, (heads, kv_heads), scale, None)? {
        return Ok(out);
    }
    let q = qkv_rope_write(qkv, angles, k_cache, v_cache, batch, heads, kv_heads, head_dim)?;
    super::paged_attention(&q, k_cache, v_cache, batch, scale)
}

/// The CUDA decode kernels with `qkv_rope_write` folded in (`cuda::qkv_rope_paged_attention`),
/// with their output and workspace given or not; `None` where they do not take the launch (not a
/// decode launch on CUDA, or a shape they are not built for).
#[cfg(feature = "cuda")]
pub(crate) fn folded_decode_attention(
    qkv: &Tensor,
    angles: &RopeAngles,
    (k_cache, v_cache): (&Tensor, &Tensor),
    batch: &PagedBatch,
    (heads, kv_heads): (usize, usize),
    scale: f64,
    into: Option<&super::cuda::AttentionInto>,
) -> Result<Option<Tensor>> {
    if !(qkv.device().is_cuda() && batch.host.write_positions.is_empty()) {
        return Ok(None);
    }
    super::cuda::qkv_rope_paged_attention(
        qkv,
        &angles.cos,
        &angles.sin,
        k_cache,
        v_cache,
        &batch.slot_mapping,
        &batch.block_tables,
        &batch.context_lens,
        &batch.cu_q_lens,
        batch.max_q_len,
        batch.max_context_len,
        scale as f32,
        heads,
        kv_heads,
        into,
    )
}

/// The composition of candle ops behind [`qkv_rope_write`] (its CPU path).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_write_reference(
    qkv: &Tensor,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let (q, k, v) = qkv_norm_rope(qkv, None, 0.0, angles, heads, kv_heads, head_dim)?;
    write_kv(k_cache, &k, batch)?;
    write_kv(v_cache, &v, batch)?;
    Ok(q)
}

/// [`qkv_rope_write`] for interleaved RoPE (pairs `2i, 2i + 1`: Huginn's), with an optional
/// learned bias `(q [heads, head_dim], k [kv_heads, head_dim])` added to q and k before it. One
/// launch on CUDA (the same float dtype throughout, angles and caches contiguous); elsewhere
/// [`qkv_bias_rope_i_write_reference`], whose roundings the kernel keeps.
#[allow(clippy::too_many_arguments)]
pub fn qkv_bias_rope_i_write(
    qkv: &Tensor,
    bias: Option<(&Tensor, &Tensor)>,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if bias_rope_kernel_takes(qkv, bias, angles, k_cache, v_cache) {
        let heads = (heads, kv_heads, head_dim);
        return super::cuda::qkv_bias_rope_i_write(&qkv.contiguous()?, bias, &angles.cos, &angles.sin, k_cache, v_cache, &batch.slot_mapping, heads, None);
    }
    qkv_bias_rope_i_write_reference(qkv, bias, angles, k_cache, v_cache, batch, heads, kv_heads, head_dim)
}

/// Whether [`qkv_bias_rope_i_write`] runs its CUDA kernel: where the split-half one would, with
/// biases (if any) of `qkv`'s dtype.
#[cfg(feature = "cuda")]
pub(crate) fn bias_rope_kernel_takes(qkv: &Tensor, bias: Option<(&Tensor, &Tensor)>, angles: &RopeAngles, k_cache: &Tensor, v_cache: &Tensor) -> bool {
    rope_write_kernel_takes(qkv, angles, k_cache, v_cache) && bias.is_none_or(|(q, k)| q.dtype() == qkv.dtype() && k.dtype() == qkv.dtype())
}

/// The composition of candle ops behind [`qkv_bias_rope_i_write`] (its CPU path): q, k and v
/// split out of `qkv`, the biases broadcast-added, candle's `rope_i` on q and k, k and v written.
#[allow(clippy::too_many_arguments)]
pub fn qkv_bias_rope_i_write_reference(
    qkv: &Tensor,
    bias: Option<(&Tensor, &Tensor)>,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let t = qkv.dim(0)?;
    let mut q = qkv.narrow(1, 0, heads * head_dim)?.reshape((t, heads, head_dim))?;
    let mut k = qkv.narrow(1, heads * head_dim, kv_heads * head_dim)?.reshape((t, kv_heads, head_dim))?;
    let v = qkv.narrow(1, (heads + kv_heads) * head_dim, kv_heads * head_dim)?.reshape((t, kv_heads, head_dim))?.contiguous()?;
    if let Some((bq, bk)) = bias {
        q = q.broadcast_add(bq)?;
        k = k.broadcast_add(bk)?;
    }
    let q = angles.apply_interleaved(&q)?;
    let k = angles.apply_interleaved(&k)?;
    write_kv(k_cache, &k, batch)?;
    write_kv(v_cache, &v, batch)?;
    Ok(q)
}

/// Like [`qkv_rope_write`] with an optional per-head RMSNorm of q and k (`qk_norm`: the q and
/// k weights `[head_dim]`, Qwen3 / SDAR) before RoPE; returns rotated q `[T, heads, head_dim]`,
/// rotated k and v `[T, kv_heads, head_dim]` (contiguous). On CUDA one launch for head dims
/// that are multiples of 64 up to 256; elsewhere [`qkv_norm_rope_write_reference`].
#[allow(clippy::too_many_arguments)]
pub fn qkv_norm_rope_write(
    qkv: &Tensor,
    qk_norm: Option<(&Tensor, &Tensor)>,
    eps: f64,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() && head_dim % 64 == 0 && head_dim <= 256 {
        let dt = qkv.dtype();
        let mut same: Vec<&Tensor> = vec![&angles.cos, &angles.sin, k_cache, v_cache];
        if let Some((qn, kn)) = qk_norm {
            same.extend([qn, kn]);
        }
        if super::is_float(dt) && same.iter().all(|t| t.dtype() == dt && t.is_contiguous()) {
            return super::cuda::qkv_norm_rope_write(
                &qkv.contiguous()?,
                qk_norm,
                eps,
                &angles.cos,
                &angles.sin,
                k_cache,
                v_cache,
                &batch.slot_mapping,
                heads,
                kv_heads,
                head_dim,
            );
        }
    }
    qkv_norm_rope_write_reference(qkv, qk_norm, eps, angles, k_cache, v_cache, batch, heads, kv_heads, head_dim)
}

/// The composition of candle ops behind [`qkv_norm_rope_write`] (its CPU path).
#[allow(clippy::too_many_arguments)]
pub fn qkv_norm_rope_write_reference(
    qkv: &Tensor,
    qk_norm: Option<(&Tensor, &Tensor)>,
    eps: f64,
    angles: &RopeAngles,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &PagedBatch,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (q, k, v) = qkv_norm_rope(qkv, qk_norm, eps, angles, heads, kv_heads, head_dim)?;
    write_kv(k_cache, &k, batch)?;
    write_kv(v_cache, &v, batch)?;
    Ok((q, k, v))
}

/// The split of the fused QKV projection `qkv` `[T, (heads + 2*kv_heads) * head_dim]` into q
/// `[T, heads, head_dim]`, k and v `[T, kv_heads, head_dim]`, with the optional per-head q/k
/// RMSNorm ([`super::rms_norm`]) and split-half RoPE applied to q and k, without a cache write:
/// the composition the fused kernels are checked against, and the path for launches that write
/// no cache.
pub fn qkv_norm_rope(
    qkv: &Tensor,
    qk_norm: Option<(&Tensor, &Tensor)>,
    eps: f64,
    angles: &RopeAngles,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (t, nh, nkv, hd) = (qkv.dim(0)?, heads, kv_heads, head_dim);
    let q = qkv.narrow(1, 0, nh * hd)?.reshape((t, nh, hd))?;
    let k = qkv.narrow(1, nh * hd, nkv * hd)?.reshape((t, nkv, hd))?;
    let v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd)?.reshape((t, nkv, hd))?.contiguous()?;
    let (q, k) = match qk_norm {
        Some((qn, kn)) => (rms_norm(&q.contiguous()?, qn, eps)?, rms_norm(&k.contiguous()?, kn, eps)?),
        None => (q, k),
    };
    Ok((angles.apply_split_half(&q)?, angles.apply_split_half(&k)?, v))
}

/// `(h2, n) = (residual + rms_norm(x, w_x), rms_norm(h2, w_next))`: a sandwich norm's residual
/// add followed by the next sub-layer's input norm. The first norm's output is rounded to the
/// dtype before the add, as with separate ops; statistics in f32.
pub fn add_rms_norm(residual: &Tensor, x: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let dt = x.dtype();
        if super::is_float(dt) && [residual, w_x, w_next].iter().all(|t| t.dtype() == dt) {
            return super::cuda::add_rms_norm(residual, x, w_x, w_next, eps as f32);
        }
    }
    add_rms_norm_reference(residual, x, w_x, w_next, eps)
}

/// The composition of candle ops behind [`add_rms_norm`] (its CPU path).
pub fn add_rms_norm_reference(residual: &Tensor, x: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let h = (residual + super::rms_norm_reference(x, w_x, eps)?)?;
    let n = super::rms_norm_reference(&h, w_next, eps)?;
    Ok((h, n))
}

/// `residual + x` (same shape and dtype): a block's residual add where no norm follows in the
/// same op (on CUDA our kernel; elsewhere candle's add, also its reference).
pub fn residual_add(residual: &Tensor, x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && super::is_float(x.dtype()) && residual.dtype() == x.dtype() && residual.dims() == x.dims() {
        return super::cuda::residual_add(residual, x);
    }
    residual + x
}

/// `(h, n) = (residual + x, rms_norm(residual + x, w))`: a pre-norm block's residual add and
/// the next sub-layer's input norm in one pass (`h` rounded to the dtype before the norm, as
/// with separate ops; statistics in f32).
pub fn residual_add_rms_norm(residual: &Tensor, x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let dt = x.dtype();
        if super::is_float(dt) && [residual, w].iter().all(|t| t.dtype() == dt) {
            return super::cuda::rms_norm(Some(residual), x, w, eps as f32);
        }
    }
    residual_add_rms_norm_reference(residual, x, w, eps)
}

/// A core step's relative latent change per row: `‖new − old‖ / ‖new‖` in f32 over the first
/// `cols` columns of `old` and `new` (`[rows, width]`, one float dtype) — the s half of a looped
/// state, what a latent-difference exit reads. `[rows]` f32; on CUDA one launch.
pub fn latent_change(old: &Tensor, new: &Tensor, cols: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if new.device().is_cuda() && super::is_float(new.dtype()) && new.rank() == 2 {
        return super::cuda::latent_change(old, new, cols);
    }
    latent_change_reference(old, new, cols)
}

/// The composition of candle ops behind [`latent_change`] (its CPU path and its reference).
pub fn latent_change_reference(old: &Tensor, new: &Tensor, cols: usize) -> Result<Tensor> {
    let new = new.narrow(D::Minus1, 0, cols)?.to_dtype(DType::F32)?;
    let old = old.narrow(D::Minus1, 0, cols)?.to_dtype(DType::F32)?;
    let change = (&new - old)?.sqr()?.sum(D::Minus1)?.sqrt()?;
    change / new.sqr()?.sum(D::Minus1)?.sqrt()?
}

/// The composition of candle ops behind [`residual_add_rms_norm`] (its CPU path).
pub fn residual_add_rms_norm_reference(residual: &Tensor, x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let h = (residual + x)?;
    let n = super::rms_norm_reference(&h, w, eps)?;
    Ok((h, n))
}

/// `silu(gate) * up`, where `gate_up` holds the two halves side by side on the last dim.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gate_up.device().is_cuda() && super::is_float(gate_up.dtype()) {
        return super::cuda::silu_mul(gate_up);
    }
    silu_mul_reference(gate_up)
}

/// The composition of candle ops behind [`silu_mul`] (its CPU path): `T(T(silu(gate)) · up)`,
/// silu computed in f32. candle's CPU silu on bf16 / f16 rounds its exponential, sum and
/// quotient each to the dtype (its CUDA silu does not), up to two steps off the f32 value: under
/// W8A8 the next product re-quantizes these activations to E4M3, where such steps flip values on
/// its boundaries, so the CPU reference rounds where the kernels do.
pub fn silu_mul_reference(gate_up: &Tensor) -> Result<Tensor> {
    let n = gate_up.dim(D::Minus1)? / 2;
    let gate = gate_up.narrow(D::Minus1, 0, n)?;
    let up = gate_up.narrow(D::Minus1, n, n)?;
    let silu = match gate.dtype() {
        DType::BF16 | DType::F16 => candle_nn::ops::silu(&gate.to_dtype(DType::F32)?)?.to_dtype(gate.dtype())?,
        _ => candle_nn::ops::silu(&gate)?,
    };
    silu * up
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// In bf16 and f16, silu is computed in f32 and rounded once, then multiplied (one more
    /// rounding): each value is `T(T(silu_f32(g)) · u)` exactly — where candle's own bf16 silu,
    /// rounding its exponential, sum and quotient, lands a step or more away on many gates.
    #[test]
    fn silu_rounds_once_in_the_16_bit_dtypes() {
        let n = 512;
        let gate: Vec<f32> = (0..n).map(|i| -8.0 + 16.0 * i as f32 / n as f32 + 0.0137).collect();
        let up: Vec<f32> = (0..n).map(|i| 0.75 + (i % 7) as f32 * 0.1).collect();
        let gu = Tensor::from_vec([gate.clone(), up.clone()].concat(), (1, 2 * n), &Device::Cpu).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let gu = gu.to_dtype(dtype).unwrap();
            let got = silu_mul_reference(&gu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (g, u) = (gu.narrow(1, 0, n).unwrap(), gu.narrow(1, n, n).unwrap());
            let round = |t: Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let (gf, uf) = (g.to_dtype(DType::F32).unwrap(), u.to_dtype(DType::F32).unwrap());
            let want = round((round(candle_nn::ops::silu(&gf).unwrap()) * uf).unwrap()).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got, want, "{dtype:?}");
            let in_dtype = (candle_nn::ops::silu(&g).unwrap() * &u).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let apart = got.iter().zip(&in_dtype).filter(|(a, b)| a != b).count();
            assert!(apart > 0, "{dtype:?}: candle's own silu should round differently somewhere");
        }
    }
}
