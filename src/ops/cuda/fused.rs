//! Fused per-layer ops (`kernels/fused.cu`): the projection epilogues that rotate q/k and
//! write the paged K/V, residual + RMSNorm, SiLU·mul. Entry points in `crate::ops::fused`.

use super::launch::{check_given, device, for_float, grid_stride_blocks, kernel, pair_given, pair_guards, same_device_dtype, view, wrap, Dest, Module};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// The arguments the fused projection epilogues share: `qkv` `[T, (H + 2*KVH) * D]`, `cos` and
/// `sin` `[T, D/2]`, caches `[NB, BS, KVH, D]` and `slot_mapping` `[T]` u32, one device, one float
/// dtype. Returns `(T, NB * BS)`.
#[allow(clippy::too_many_arguments)]
fn check_qkv_rope(
    op: &str,
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(usize, usize)> {
    same_device_dtype(op, qkv.dtype(), qkv, &[("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)])?;
    if !slot_mapping.device().same_device(qkv.device()) || slot_mapping.dtype() != DType::U32 {
        bail!("{op} (cuda): slot_mapping must be u32 on the device of qkv");
    }
    let (tokens, width) = qkv.dims2()?;
    if width != (heads + 2 * kv_heads) * head_dim {
        bail!("{op} (cuda): qkv width {width} vs heads {heads}, kv heads {kv_heads}, head dim {head_dim}");
    }
    let (nb, bs, kvh, hd) = k_cache.dims4()?;
    if kvh != kv_heads || hd != head_dim || v_cache.dims() != k_cache.dims() {
        bail!("{op} (cuda): caches {:?} / {:?} vs kv heads {kv_heads}, head dim {head_dim}", k_cache.dims(), v_cache.dims());
    }
    if cos.dims() != [tokens, head_dim / 2] || sin.dims() != cos.dims() || slot_mapping.dims() != [tokens] {
        bail!("{op} (cuda): cos {:?}, sin {:?}, slot_mapping {:?} for {tokens} tokens", cos.dims(), sin.dims(), slot_mapping.dims());
    }
    if tokens * width > i32::MAX as usize {
        bail!("{op} (cuda): sizes out of range");
    }
    Ok((tokens, nb * bs))
}

/// Splits `qkv` `[T, (H + 2*KVH) * D]`, rotates q and k (split-half RoPE with `cos`/`sin`
/// `[T, D/2]`), writes rotated k and v into the caches `[NB, BS, KVH, D]` in place at
/// `slot_mapping[t]` (`[T]` u32, flat row `block * BS + offset`), and returns q `[T, H, D]`.
/// All float tensors share one dtype and must be contiguous. Slots past the cache are skipped.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_write(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    qkv_rope_write_to(qkv, cos, sin, k_cache, v_cache, slot_mapping, (heads, kv_heads, head_dim), Rotation::SplitHalf, None)
}

/// [`qkv_rope_write`] for interleaved RoPE (pairs `2i, 2i + 1`, Huginn's), with an optional
/// learned bias `(q [H, D], k [KVH, D])` added to q and k before it. Rounded as the CPU
/// composition it replaces: `T(x + b)`, then candle's `rope_i` in the dtype's own arithmetic.
#[allow(clippy::too_many_arguments)]
pub fn qkv_bias_rope_i_write(
    qkv: &Tensor,
    bias: Option<(&Tensor, &Tensor)>,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    heads: (usize, usize, usize),
    q_out: Option<&Tensor>,
) -> Result<Tensor> {
    qkv_rope_write_to(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, Rotation::Interleaved(bias), q_out)
}

/// How the fused epilogue rotates q and k.
#[derive(Clone, Copy)]
enum Rotation<'a> {
    /// Split-half RoPE (`rotate_half`) on q and k as they come (`qkv_rope_write_*`).
    SplitHalf,
    /// Interleaved RoPE after an optional bias on q and k (`qkv_bias_rope_i_write_*`).
    Interleaved(Option<(&'a Tensor, &'a Tensor)>),
}

/// [`qkv_rope_write`] with q written into `q_out` (`[T, H, D]`, contiguous).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_write_into(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    heads: (usize, usize, usize),
    q_out: &Tensor,
) -> Result<()> {
    qkv_rope_write_to(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, Rotation::SplitHalf, Some(q_out)).map(|_| ())
}

#[allow(clippy::too_many_arguments)]
fn qkv_rope_write_to(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    rotation: Rotation,
    q_out: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "qkv_rope_write";
    let dev = device(qkv, OP)?;
    let dtype = qkv.dtype();
    if head_dim % 2 != 0 {
        bail!("{OP} (cuda): odd head dim {head_dim}");
    }
    let (tokens, num_slots) = check_qkv_rope(OP, qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim)?;
    let pairs = (heads + kv_heads) * (head_dim / 2) + kv_heads * (head_dim / 2);
    if pairs == 0 {
        bail!("{OP} (cuda): sizes out of range");
    }
    check_given(OP, "q", qkv, dtype, &[tokens, heads, head_dim], q_out)?;
    if let Rotation::Interleaved(Some((bq, bk))) = rotation {
        same_device_dtype(OP, dtype, qkv, &[("q bias", bq), ("k bias", bk)])?;
        if bq.dims() != [heads, head_dim] || bk.dims() != [kv_heads, head_dim] {
            bail!("{OP} (cuda): biases {:?} / {:?} for {heads} / {kv_heads} heads of {head_dim}", bq.dims(), bk.dims());
        }
    }
    if tokens == 0 {
        return Tensor::zeros((0, heads, head_dim), dtype, qkv.device());
    }
    let shape = [heads, kv_heads, head_dim, num_slots, pairs];
    for_float!(dtype, OP, |T, suf| qkv_rope_launch::<T>(&dev, suf, qkv, rotation, [cos, sin], [k_cache, v_cache], slot_mapping, shape, q_out))
}

#[allow(clippy::too_many_arguments)]
fn qkv_rope_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    qkv: &Tensor,
    rotation: Rotation,
    [cos, sin]: [&Tensor; 2],
    [k_cache, v_cache]: [&Tensor; 2],
    slot_mapping: &Tensor,
    [heads, kv_heads, head_dim, num_slots, pairs]: [usize; 5],
    given: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "qkv_rope_write";
    let tokens = qkv.dim(0)?;
    let (qs, ql) = qkv.storage_and_layout();
    let (cs, cl) = cos.storage_and_layout();
    let (ss, sl) = sin.storage_and_layout();
    let (ks, kl) = k_cache.storage_and_layout();
    let (vs, vl) = v_cache.storage_and_layout();
    let (ms, ml) = slot_mapping.storage_and_layout();
    let qkv_v = view::<T>(&qs, ql, OP, "qkv", false)?;
    let cos_v = view::<T>(&cs, cl, OP, "cos", false)?;
    let sin_v = view::<T>(&ss, sl, OP, "sin", false)?;
    // The caches are written in place through views taken under the storage read lock (candle
    // keeps the write lock crate-private). The write is ordered by the stream: every use of the
    // KV store's tensors (attention reads, these writes) is queued on this device's one stream.
    let k_v = view::<T>(&ks, kl, OP, "k_cache", false)?;
    let v_v = view::<T>(&vs, vl, OP, "v_cache", false)?;
    let slots = view::<u32>(&ms, ml, OP, "slot_mapping", false)?;
    let given_sl = given.map(|t| t.storage_and_layout());
    // SAFETY: every (token, head, dim) of q is written by the kernel (one thread per pair).
    let mut q_out = unsafe { Dest::<T>::new(dev, tokens * heads * head_dim, given_sl.as_ref().map(|(s, l)| (&**s, *l)), OP, "q")? };
    let bias = match rotation {
        Rotation::Interleaved(Some((bq, bk))) => Some((bq.contiguous()?, bk.contiguous()?)),
        _ => None,
    };
    let bias_sl = bias.as_ref().map(|(bq, bk)| (bq.storage_and_layout(), bk.storage_and_layout()));
    let bias_v = bias_sl
        .as_ref()
        .map(|((qs, ql), (ks, kl))| Ok::<_, candle_core::Error>((view::<T>(qs, ql, OP, "q bias", false)?, view::<T>(ks, kl, OP, "k bias", false)?)))
        .transpose()?;
    let stream = dev.cuda_stream();
    let bias_ptrs = bias_v.as_ref().map(|(q, k)| (q.device_ptr(&stream), k.device_ptr(&stream)));
    // Null pointers for no bias (the kernel checks them).
    let (bq_arg, bk_arg): (u64, u64) = bias_ptrs.as_ref().map_or((0, 0), |((q, _), (k, _))| (*q, *k));
    let name = match rotation {
        Rotation::SplitHalf => format!("qkv_rope_write_{suf}"),
        Rotation::Interleaved(_) => format!("qkv_bias_rope_i_write_{suf}"),
    };
    let func = kernel!(dev, Module::Fused, &name)?;
    const THREADS: usize = 256;
    let cfg = LaunchConfig { grid_dim: (tokens as u32, pairs.div_ceil(THREADS) as u32, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    let (h, kvh, hd, ns) = (heads as i32, kv_heads as i32, head_dim as i32, num_slots as i64);
    let mut b = func.builder();
    q_out.push(&mut b);
    b.arg(&k_v).arg(&v_v).arg(&qkv_v);
    if let Rotation::Interleaved(_) = rotation {
        b.arg(&bq_arg).arg(&bk_arg);
    }
    b.arg(&cos_v).arg(&sin_v).arg(&slots);
    b.arg(&h).arg(&kvh).arg(&hd).arg(&ns);
    // SAFETY: argument list matches `qkv_rope_write_*` or `qkv_bias_rope_i_write_*` (with the
    // bias pointers, null for none; each bias holds heads × head dim values) in fused.cu; shapes
    // checked by the caller.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    drop(bias_ptrs);
    Ok(q_out.finish(dev, (tokens, heads, head_dim), given))
}

/// [`qkv_rope_write`] with an optional per-head RMSNorm of q and k before RoPE, returning
/// `(q [T, H, D], k [T, KVH, D], v [T, KVH, D])`; D a multiple of 64, at most 256.
#[allow(clippy::too_many_arguments)]
pub fn qkv_norm_rope_write(
    qkv: &Tensor,
    qk_norm: Option<(&Tensor, &Tensor)>,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "qkv_norm_rope_write";
    let dev = device(qkv, OP)?;
    let dtype = qkv.dtype();
    if head_dim % 64 != 0 || head_dim > 256 {
        bail!("{OP} (cuda): head dim {head_dim} (a multiple of 64 up to 256)");
    }
    if let Some((qn, kn)) = qk_norm {
        same_device_dtype(OP, dtype, qkv, &[("q_norm", qn), ("k_norm", kn)])?;
        if qn.dims() != [head_dim] || kn.dims() != [head_dim] {
            bail!("{OP} (cuda): q/k norm weights {:?} / {:?} for head dim {head_dim}", qn.dims(), kn.dims());
        }
    }
    let (tokens, num_slots) = check_qkv_rope(OP, qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim)?;
    if tokens == 0 {
        let z = |h: usize| Tensor::zeros((0, h, head_dim), dtype, qkv.device());
        return Ok((z(heads)?, z(kv_heads)?, z(kv_heads)?));
    }
    let a = NormRopeArgs { qkv, qk_norm, eps, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim, num_slots };
    for_float!(dtype, OP, |T, suf| norm_rope_launch::<T>(&dev, suf, &a))
}

struct NormRopeArgs<'a> {
    qkv: &'a Tensor,
    qk_norm: Option<(&'a Tensor, &'a Tensor)>,
    eps: f64,
    cos: &'a Tensor,
    sin: &'a Tensor,
    k_cache: &'a Tensor,
    v_cache: &'a Tensor,
    slot_mapping: &'a Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    num_slots: usize,
}

fn norm_rope_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, a: &NormRopeArgs) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "qkv_norm_rope_write";
    let tokens = a.qkv.dim(0)?;
    let (qs, ql) = a.qkv.storage_and_layout();
    let (cs, cl) = a.cos.storage_and_layout();
    let (ss, sl) = a.sin.storage_and_layout();
    let (ks, kl) = a.k_cache.storage_and_layout();
    let (vs, vl) = a.v_cache.storage_and_layout();
    let (ms, ml) = a.slot_mapping.storage_and_layout();
    // Without q/k norm the weight arguments are never read; cos stands in for them.
    let (qn, kn) = a.qk_norm.unwrap_or((a.cos, a.cos));
    let (qns, qnl) = qn.storage_and_layout();
    let (kns, knl) = kn.storage_and_layout();
    let qkv_v = view::<T>(&qs, ql, OP, "qkv", true)?;
    let cos_v = view::<T>(&cs, cl, OP, "cos", true)?;
    let sin_v = view::<T>(&ss, sl, OP, "sin", true)?;
    // Caches written in place under the read lock, ordered by the device's one stream (see
    // `qkv_rope_launch`).
    let k_v = view::<T>(&ks, kl, OP, "k_cache", true)?;
    let v_v = view::<T>(&vs, vl, OP, "v_cache", true)?;
    let slots = view::<u32>(&ms, ml, OP, "slot_mapping", false)?;
    let qn_v = view::<T>(&qns, qnl, OP, "q_norm", true)?;
    let kn_v = view::<T>(&kns, knl, OP, "k_norm", true)?;
    let (h, kvh, hd) = (a.heads, a.kv_heads, a.head_dim);
    // SAFETY: one warp per (token, head) writes every element of q, k and v.
    let mut q_out = unsafe { dev.alloc::<T>(tokens * h * hd)? };
    let mut k_out = unsafe { dev.alloc::<T>(tokens * kvh * hd)? };
    let mut v_out = unsafe { dev.alloc::<T>(tokens * kvh * hd)? };
    let func = kernel!(dev, Module::Fused, &format!("qkv_norm_rope_write_{suf}"))?;
    const WARPS: usize = 4;
    let units = h + 2 * kvh;
    let cfg = LaunchConfig { grid_dim: (tokens as u32, units.div_ceil(WARPS) as u32, 1), block_dim: (32 * WARPS as u32, 1, 1), shared_mem_bytes: 0 };
    let (hi, kvhi, hdi, norm, eps, ns) = (h as i32, kvh as i32, hd as i32, a.qk_norm.is_some() as i32, a.eps as f32, a.num_slots as i64);
    let mut b = func.builder();
    b.arg(&mut q_out).arg(&mut k_out).arg(&mut v_out).arg(&k_v).arg(&v_v).arg(&qkv_v).arg(&qn_v).arg(&kn_v).arg(&norm);
    b.arg(&cos_v).arg(&sin_v).arg(&slots).arg(&hi).arg(&kvhi).arg(&hdi).arg(&eps).arg(&ns);
    // SAFETY: argument list matches `qkv_norm_rope_write_*` in fused.cu; shapes checked by the caller.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok((wrap(q_out, dev, (tokens, h, hd)), wrap(k_out, dev, (tokens, kvh, hd)), wrap(v_out, dev, (tokens, kvh, hd))))
}

/// `(h2, n) = (residual + rms_norm(x, w_x), rms_norm(h2, w_next))` over the last dim, in one
/// launch. `residual`, `x` `[.., C]` and the weights `[C]` share one dtype; f32 statistics.
pub fn add_rms_norm(residual: &Tensor, x: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    add_rms_norm_to(TwoNorms::Sandwich, residual, x, w_x, w_next, eps, None)
}

/// [`add_rms_norm`] writing `(h, n)` into `outs` (each of `x`'s shape and dtype, contiguous;
/// neither may alias an input).
pub fn add_rms_norm_into(residual: &Tensor, x: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f32, h: &Tensor, n: &Tensor) -> Result<()> {
    add_rms_norm_to(TwoNorms::Sandwich, residual, x, w_x, w_next, eps, Some((h, n))).map(|_| ())
}

/// `(h, n) = (rms_norm(residual + x, w), rms_norm(h, w_next))` into the given buffers (each of
/// `x`'s shape and dtype, contiguous; neither may alias an input), in one launch: a residual
/// stream normalised after each add (Huginn's sandwich blocks) and the norm that next reads it,
/// rounded as [`rms_norm`] with a residual and then without. Bit for bit the same as those two
/// launches where all three take the same path: every buffer 16-byte aligned (a fresh
/// allocation, or a view of one at a row boundary) and the width a whole number of 16-byte
/// vectors, or the width not one (then all take the scalar path).
pub fn post_norm_into(residual: &Tensor, x: &Tensor, w: &Tensor, w_next: &Tensor, eps: f32, h: &Tensor, n: &Tensor) -> Result<()> {
    add_rms_norm_to(TwoNorms::Post, residual, x, w, w_next, eps, Some((h, n))).map(|_| ())
}

/// Which of the two-norm row kernels: the branch normalised before the add (`add_rms_norm_*`),
/// or the sum after it (`post_norm_*`).
#[derive(Clone, Copy)]
enum TwoNorms {
    Sandwich,
    Post,
}

fn add_rms_norm_to(
    kind: TwoNorms,
    residual: &Tensor,
    x: &Tensor,
    w_x: &Tensor,
    w_next: &Tensor,
    eps: f32,
    outs: Option<(&Tensor, &Tensor)>,
) -> Result<(Tensor, Tensor)> {
    // The op's name is its kernel's, less the dtype suffix.
    let op = match kind {
        TwoNorms::Sandwich => "add_rms_norm",
        TwoNorms::Post => "post_norm",
    };
    let dev = device(x, op)?;
    let dtype = x.dtype();
    same_device_dtype(op, dtype, x, &[("residual", residual), ("w_x", w_x), ("w_next", w_next)])?;
    check_given(op, "h", x, dtype, x.dims(), outs.map(|o| o.0))?;
    check_given(op, "n", x, dtype, x.dims(), outs.map(|o| o.1))?;
    if residual.dims() != x.dims() {
        bail!("{op} (cuda): residual {:?} vs x {:?}", residual.dims(), x.dims());
    }
    let ncols = x.dim(candle_core::D::Minus1)?;
    if w_x.dims1()? != ncols || w_next.dims1()? != ncols {
        bail!("{op} (cuda): weights {:?} / {:?} for {ncols} columns", w_x.dims(), w_next.dims());
    }
    let rows = x.elem_count() / ncols.max(1);
    if ncols == 0 || rows == 0 {
        return Ok((residual.clone(), x.zeros_like()?));
    }
    if ncols > i32::MAX as usize || rows > u32::MAX as usize / 2 {
        bail!("{op} (cuda): sizes out of range");
    }
    let residual = residual.contiguous()?;
    let x = x.contiguous()?;
    let (w_x, w_next) = (w_x.contiguous()?, w_next.contiguous()?);
    for_float!(dtype, op, |T, suf| add_rms_launch::<T>(&dev, op, suf, &residual, &x, &w_x, &w_next, rows, ncols, eps, outs))
}

/// Launches `{op}_{suf}` (`add_rms_norm_*` or `post_norm_*`: one argument list).
#[allow(clippy::too_many_arguments)]
fn add_rms_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    op: &str,
    suf: &str,
    residual: &Tensor,
    x: &Tensor,
    w_x: &Tensor,
    w_next: &Tensor,
    rows: usize,
    ncols: usize,
    eps: f32,
    outs: Option<(&Tensor, &Tensor)>,
) -> Result<(Tensor, Tensor)> {
    let (rs, rl) = residual.storage_and_layout();
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w_x.storage_and_layout();
    let (ns, nl) = w_next.storage_and_layout();
    let r_v = view::<T>(&rs, rl, op, "residual", false)?;
    let x_v = view::<T>(&xs, xl, op, "x", false)?;
    let w_v = view::<T>(&ws, wl, op, "w_x", false)?;
    let n_v = view::<T>(&ns, nl, op, "w_next", false)?;
    let guards = pair_guards(outs);
    let [h_given, n_given] = pair_given(&guards);
    // SAFETY: the kernel writes every element of both outputs (one block per row).
    let mut h_out = unsafe { Dest::<T>::new(dev, rows * ncols, h_given, op, "h")? };
    let mut n_out = unsafe { Dest::<T>::new(dev, rows * ncols, n_given, op, "n")? };
    let func = kernel!(dev, Module::Fused, &format!("{op}_{suf}"))?;
    let cfg = row_norm_config(rows, ncols);
    let nc = ncols as i32;
    let mut b = func.builder();
    h_out.push(&mut b);
    n_out.push(&mut b);
    b.arg(&r_v).arg(&x_v).arg(&w_v).arg(&n_v);
    b.arg(&nc).arg(&eps);
    // SAFETY: argument list matches `add_rms_norm_*` and `post_norm_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    let shape = x.shape().clone();
    Ok((h_out.finish(dev, shape.clone(), outs.map(|o| o.0)), n_out.finish(dev, shape, outs.map(|o| o.1))))
}

/// Launch shape of the row norms (`add_rms_norm_*`, `rms_norm_*`, `add_rms_norm_pre_*`): one
/// block per row, ~8 columns per thread, a multiple of 32 threads, at most 512 (the kernels'
/// `__launch_bounds__`: they hold a thread's loads in registers to issue them together).
pub(super) fn row_norm_config(rows: usize, ncols: usize) -> LaunchConfig {
    let threads = ncols.div_ceil(8).next_power_of_two().clamp(32, 512);
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 }
}

/// `rms_norm(x, w)` over the last dim (`x` `[.., C]`, `w` `[C]`, one dtype; f32 statistics), or
/// with `residual` the pre-norm residual step `(h, n) = (residual + x, rms_norm(residual + x,
/// w))`; one launch either way. Returns `(h, n)`, `h` = `x` without a residual.
pub fn rms_norm(residual: Option<&Tensor>, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    rms_norm_to(residual, x, w, eps, None, None)
}

/// `rms_norm(x, w)` written into `out` (`x`'s shape and dtype, contiguous, not aliasing `x`).
pub fn rms_norm_into(x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()> {
    rms_norm_to(None, x, w, eps, None, Some(out)).map(|_| ())
}

/// The pre-norm residual step of [`rms_norm`] writing `(h, n)` into the given buffers (each of
/// `x`'s shape and dtype, contiguous; neither may alias an input).
pub fn residual_add_rms_norm_into(residual: &Tensor, x: &Tensor, w: &Tensor, eps: f32, h: &Tensor, n: &Tensor) -> Result<()> {
    rms_norm_to(Some(residual), x, w, eps, Some(h), Some(n)).map(|_| ())
}

fn rms_norm_to(residual: Option<&Tensor>, x: &Tensor, w: &Tensor, eps: f32, h_out: Option<&Tensor>, out: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let op = if residual.is_some() { "add_rms_norm_pre" } else { "rms_norm" };
    let dev = device(x, op)?;
    let dtype = x.dtype();
    same_device_dtype(op, dtype, x, &[("w", w)])?;
    if let Some(r) = residual {
        same_device_dtype(op, dtype, x, &[("residual", r)])?;
        if r.dims() != x.dims() {
            bail!("{op} (cuda): residual {:?} vs x {:?}", r.dims(), x.dims());
        }
    }
    check_given(op, "out", x, dtype, x.dims(), out)?;
    check_given(op, "h", x, dtype, x.dims(), h_out)?;
    if residual.is_none() && h_out.is_some() {
        bail!("{op} (cuda): an h output is written only with a residual");
    }
    let ncols = x.dim(candle_core::D::Minus1)?;
    if w.dims1()? != ncols {
        bail!("{op} (cuda): weight {:?} for {ncols} columns", w.dims());
    }
    let rows = x.elem_count() / ncols.max(1);
    if ncols == 0 || rows == 0 {
        let h = match residual {
            Some(r) => (r + x)?,
            None => x.clone(),
        };
        return Ok((h, x.zeros_like()?));
    }
    if ncols > i32::MAX as usize || rows > u32::MAX as usize / 2 {
        bail!("{op} (cuda): sizes out of range");
    }
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    let residual = residual.map(Tensor::contiguous).transpose()?;
    for_float!(dtype, op, |T, suf| rms_norm_launch::<T>(&dev, suf, op, residual.as_ref(), &x, &w, rows, ncols, eps, (h_out, out)))
}

#[allow(clippy::too_many_arguments)]
fn rms_norm_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    op: &str,
    residual: Option<&Tensor>,
    x: &Tensor,
    w: &Tensor,
    rows: usize,
    ncols: usize,
    eps: f32,
    (h_given, out): (Option<&Tensor>, Option<&Tensor>),
) -> Result<(Tensor, Tensor)> {
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let x_v = view::<T>(&xs, xl, op, "x", false)?;
    let w_v = view::<T>(&ws, wl, op, "w", false)?;
    let given = out.map(|t| t.storage_and_layout());
    // SAFETY: the kernel writes every element of its outputs (one block per row).
    let mut n_out = unsafe { Dest::<T>::new(dev, rows * ncols, given.as_ref().map(|(s, l)| (&**s, *l)), op, "out")? };
    let cfg = row_norm_config(rows, ncols);
    let nc = ncols as i32;
    let shape = x.shape().clone();
    match residual {
        None => {
            let func = kernel!(dev, Module::Fused, &format!("rms_norm_{suf}"))?;
            let mut b = func.builder();
            n_out.push(&mut b);
            b.arg(&x_v).arg(&w_v).arg(&nc).arg(&eps);
            // SAFETY: argument list matches `rms_norm_*` in fused.cu.
            unsafe { b.launch(cfg) }.w()?;
            drop(b);
            Ok((x.clone(), n_out.finish(dev, shape, out)))
        }
        Some(r) => {
            let (rs, rl) = r.storage_and_layout();
            let r_v = view::<T>(&rs, rl, op, "residual", false)?;
            let h_guard = h_given.map(|t| t.storage_and_layout());
            // SAFETY: as n_out.
            let mut h_out = unsafe { Dest::<T>::new(dev, rows * ncols, h_guard.as_ref().map(|(s, l)| (&**s, *l)), op, "h")? };
            let func = kernel!(dev, Module::Fused, &format!("add_rms_norm_pre_{suf}"))?;
            let mut b = func.builder();
            h_out.push(&mut b);
            n_out.push(&mut b);
            b.arg(&r_v).arg(&x_v).arg(&w_v).arg(&nc).arg(&eps);
            // SAFETY: argument list matches `add_rms_norm_pre_*` in fused.cu.
            unsafe { b.launch(cfg) }.w()?;
            drop(b);
            Ok((h_out.finish(dev, shape.clone(), h_given), n_out.finish(dev, shape, out)))
        }
    }
}

/// `a + b` for two tensors of one shape and float dtype, in one launch (16-byte vectors when
/// the sizes allow).
pub fn residual_add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "residual_add";
    let dev = device(a, OP)?;
    let dtype = a.dtype();
    same_device_dtype(OP, dtype, a, &[("b", b)])?;
    if a.dims() != b.dims() {
        bail!("{OP} (cuda): {:?} vs {:?}", a.dims(), b.dims());
    }
    let n = a.elem_count();
    if n == 0 {
        return a.zeros_like();
    }
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    for_float!(dtype, OP, |T, suf| residual_add_launch::<T>(&dev, suf, &a, &b, n))
}

fn residual_add_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, a: &Tensor, b: &Tensor, n: usize) -> Result<Tensor> {
    const OP: &str = "residual_add";
    let (as_, al) = a.storage_and_layout();
    let (bs, bl) = b.storage_and_layout();
    let a_v = view::<T>(&as_, al, OP, "a", false)?;
    let b_v = view::<T>(&bs, bl, OP, "b", false)?;
    // SAFETY: the grid-stride loop writes every element.
    let mut out = unsafe { dev.alloc::<T>(n)? };
    let func = kernel!(dev, Module::Fused, &format!("residual_add_{suf}"))?;
    const THREADS: usize = 256;
    let per_thread = 16 / std::mem::size_of::<T>();
    let blocks = grid_stride_blocks(dev, n.div_ceil(THREADS * per_thread))?;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    let len = n as i64;
    let mut bld = func.builder();
    bld.arg(&mut out).arg(&a_v).arg(&b_v).arg(&len);
    // SAFETY: argument list matches `residual_add_*` in fused.cu.
    unsafe { bld.launch(cfg) }.w()?;
    drop(bld);
    Ok(wrap(out, dev, a.shape().clone()))
}

/// RoPE angles: `cos` / `sin` `[T, D/2]` in `dtype` of `float(positions[t]) * inv_freq[0, j]`
/// (`positions` `[T]` u32, `inv_freq` `[1, D/2]` f32, one device), in one launch — the same
/// arithmetic as `RopeTable`'s candle composition.
pub fn rope_angles(positions: &Tensor, inv_freq: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
    rope_angles_to(positions, inv_freq, dtype, None)
}

/// [`rope_angles`] written into `cos` and `sin` (`[T, D/2]` of `dtype`, contiguous).
pub fn rope_angles_into(positions: &Tensor, inv_freq: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<()> {
    rope_angles_to(positions, inv_freq, cos.dtype(), Some((cos, sin))).map(|_| ())
}

fn rope_angles_to(positions: &Tensor, inv_freq: &Tensor, dtype: DType, outs: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rope_angles";
    let dev = device(positions, OP)?;
    if positions.dtype() != DType::U32 || inv_freq.dtype() != DType::F32 || !inv_freq.device().same_device(positions.device()) {
        bail!("{OP} (cuda): positions must be u32 and inv_freq f32, on one device");
    }
    let tokens = positions.dims1()?;
    let (one, half) = inv_freq.dims2()?;
    if one != 1 || half > i32::MAX as usize {
        bail!("{OP} (cuda): inv_freq {:?}, expected [1, D/2]", inv_freq.dims());
    }
    check_given(OP, "cos", positions, dtype, &[tokens, half], outs.map(|o| o.0))?;
    check_given(OP, "sin", positions, dtype, &[tokens, half], outs.map(|o| o.1))?;
    if tokens * half == 0 {
        let z = Tensor::zeros((tokens, half), dtype, positions.device())?;
        return Ok((z.clone(), z));
    }
    let (positions, inv_freq) = (positions.contiguous()?, inv_freq.contiguous()?);
    for_float!(dtype, OP, |T, suf| rope_angles_launch::<T>(&dev, suf, &positions, &inv_freq, tokens, half, outs))
}

fn rope_angles_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    positions: &Tensor,
    inv_freq: &Tensor,
    tokens: usize,
    half: usize,
    outs: Option<(&Tensor, &Tensor)>,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rope_angles";
    let (ps, pl) = positions.storage_and_layout();
    let (fs, fl) = inv_freq.storage_and_layout();
    let p_v = view::<u32>(&ps, pl, OP, "positions", false)?;
    let f_v = view::<f32>(&fs, fl, OP, "inv_freq", false)?;
    let n = tokens * half;
    let guards = pair_guards(outs);
    let [cos_given, sin_given] = pair_given(&guards);
    // SAFETY: the grid-stride loop writes every element of both outputs.
    let mut cos = unsafe { Dest::<T>::new(dev, n, cos_given, OP, "cos")? };
    let mut sin = unsafe { Dest::<T>::new(dev, n, sin_given, OP, "sin")? };
    let func = kernel!(dev, Module::Fused, &format!("rope_angles_{suf}"))?;
    const THREADS: usize = 256;
    let cfg = LaunchConfig { grid_dim: (grid_stride_blocks(dev, n.div_ceil(THREADS))?, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    let (t, h) = (tokens as i64, half as i32);
    let mut b = func.builder();
    cos.push(&mut b);
    sin.push(&mut b);
    b.arg(&p_v).arg(&f_v).arg(&t).arg(&h);
    // SAFETY: argument list matches `rope_angles_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok((cos.finish(dev, (tokens, half), outs.map(|o| o.0)), sin.finish(dev, (tokens, half), outs.map(|o| o.1))))
}

/// `silu(gate) * up` for `gate_up` `[.., 2I]` (gate first), output `[.., I]`, one launch.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    silu_mul_to(gate_up, None)
}

/// [`silu_mul`] written into `out` (`[.., I]` of `gate_up`'s dtype, contiguous).
pub fn silu_mul_into(gate_up: &Tensor, out: &Tensor) -> Result<()> {
    silu_mul_to(gate_up, Some(out)).map(|_| ())
}

fn silu_mul_to(gate_up: &Tensor, out: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "silu_mul";
    let dev = device(gate_up, OP)?;
    let dtype = gate_up.dtype();
    let two_i = gate_up.dim(candle_core::D::Minus1)?;
    if two_i % 2 != 0 {
        bail!("{OP} (cuda): last dim {two_i} is odd");
    }
    let inter = two_i / 2;
    let mut dims = gate_up.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = inter;
    check_given(OP, "out", gate_up, dtype, &dims, out)?;
    let rows = gate_up.elem_count() / two_i.max(1);
    if rows * inter == 0 {
        return Tensor::zeros(dims, dtype, gate_up.device());
    }
    let gate_up = gate_up.contiguous()?;
    for_float!(dtype, OP, |T, suf| silu_mul_launch::<T>(&dev, suf, &gate_up, rows, inter, dims, out))
}

fn silu_mul_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    gate_up: &Tensor,
    rows: usize,
    inter: usize,
    dims: Vec<usize>,
    given: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "silu_mul";
    let (gs, gl) = gate_up.storage_and_layout();
    let g_v = view::<T>(&gs, gl, OP, "gate_up", false)?;
    let n = rows * inter;
    let given_sl = given.map(|t| t.storage_and_layout());
    // SAFETY: the grid-stride loop writes every output element.
    let mut out = unsafe { Dest::<T>::new(dev, n, given_sl.as_ref().map(|(s, l)| (&**s, *l)), OP, "out")? };
    let func = kernel!(dev, Module::Fused, &format!("silu_mul_{suf}"))?;
    const THREADS: usize = 256;
    // A thread per 16-byte vector of outputs where the kernel takes the vector path (the width a
    // whole number of vectors; the pointers are allocations, aligned).
    let vec = 16 / std::mem::size_of::<T>();
    let per_thread = if inter % vec == 0 { vec } else { 1 };
    let cfg =
        LaunchConfig { grid_dim: (grid_stride_blocks(dev, n.div_ceil(THREADS * per_thread))?, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    let (r, i) = (rows as i64, inter as i32);
    if inter > i32::MAX as usize {
        bail!("{OP} (cuda): intermediate size out of range");
    }
    let mut b = func.builder();
    out.push(&mut b);
    b.arg(&g_v).arg(&r).arg(&i);
    // SAFETY: argument list matches `silu_mul_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(out.finish(dev, dims, given))
}
