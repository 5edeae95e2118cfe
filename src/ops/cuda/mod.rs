//! CUDA kernels of our own (feature `cuda`). The PTX is built from `src/ops/kernels/*.cu` by
//! `build.rs` and loaded through candle's `CudaDevice::get_or_load_custom_func`.

use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ponder_kernels.rs"));
}

const PA_MODULE: &str = "ponder_paged_attention";
/// Warps per thread block of the attention kernel (`NW` in the .cu file).
const NW: usize = 4;
/// Query items (token x head of a GQA group) per row from which the tensor-core kernel is used.
const MMA_MIN_ITEMS: usize = 16;
/// Query items per block of the tensor-core kernel (`MMA_NQ` in the .cu file).
const MMA_NQ: usize = 64;
/// Blocks that keep the GPU busy enough for a memory-bound pass (H100/H200: 132 SMs).
const TARGET_BLOCKS: usize = 132 * 8;

/// Paged attention on CUDA; see [`crate::ops::paged_attention`] for the semantics.
///
/// `q` `[T, H, D]`; caches `[num_blocks, block_size, kv_heads, D]` (contiguous, dtype of `q`);
/// `block_tables` `[R, max_blocks]` u32; `context_lens` `[R]` u32; `cu_q_lens` `[R + 1]` u32 with
/// `cu_q_lens[R] == T`. Keys are read in place through the block table. Output `[T, H, D]`, dtype
/// of `q`. `max_q_len` picks the query tile; `max_context_len` only sizes the key split (it must
/// be at least every row's context length).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    context_lens: &Tensor,
    cu_q_lens: &Tensor,
    max_q_len: usize,
    max_context_len: usize,
    scale: f32,
    mask_block: u32,
) -> Result<Tensor> {
    let dev = match q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        d => bail!("paged attention (cuda): q is on {d:?}"),
    };
    for (name, t) in [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("context_lens", context_lens), ("cu_q_lens", cu_q_lens)] {
        if !t.device().same_device(q.device()) {
            bail!("paged attention (cuda): {name} is on {:?}, q on {:?}", t.device(), q.device());
        }
    }
    let (tokens, heads, hd) = q.dims3()?;
    let (_num_blocks, block_size, kv_heads, khd) = k_cache.dims4()?;
    if v_cache.dims() != k_cache.dims() {
        bail!("paged attention (cuda): v_cache {:?} vs k_cache {:?}", v_cache.dims(), k_cache.dims());
    }
    if khd != hd {
        bail!("paged attention (cuda): q head dim {hd}, cache head dim {khd}");
    }
    if !matches!(hd, 64 | 96 | 128) {
        bail!("paged attention (cuda): head dim {hd} not supported (64, 96, 128)");
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        bail!("paged attention (cuda): {heads} query heads not a multiple of {kv_heads} kv heads");
    }
    if block_size == 0 {
        bail!("paged attention (cuda): block size 0");
    }
    let dtype = q.dtype();
    if k_cache.dtype() != dtype || v_cache.dtype() != dtype {
        bail!("paged attention (cuda): dtypes q {dtype:?}, k {:?}, v {:?}", k_cache.dtype(), v_cache.dtype());
    }
    for (name, t) in [("block_tables", block_tables), ("context_lens", context_lens), ("cu_q_lens", cu_q_lens)] {
        if t.dtype() != DType::U32 {
            bail!("paged attention (cuda): {name} must be u32, got {:?}", t.dtype());
        }
    }
    let (rows, max_blocks) = block_tables.dims2()?;
    if context_lens.dims1()? != rows || cu_q_lens.dims1()? != rows + 1 {
        bail!("paged attention (cuda): {rows} table rows, context_lens {:?}, cu_q_lens {:?}", context_lens.dims(), cu_q_lens.dims());
    }
    let i32_ok = |x: usize| x <= i32::MAX as usize;
    if !(i32_ok(tokens * heads) && i32_ok(rows + 1) && i32_ok(max_blocks) && i32_ok(max_context_len)) {
        bail!("paged attention (cuda): sizes exceed i32");
    }
    if tokens == 0 || rows == 0 {
        return Tensor::zeros((tokens, heads, hd), dtype, q.device());
    }
    // Vector loads need 16-byte aligned rows: copy q if a view starts off alignment.
    let elem = dtype.size_in_bytes();
    let mut q = q.contiguous()?;
    if (q.layout().start_offset() * elem) % 16 != 0 {
        q = q.copy()?;
    }
    let group = heads / kv_heads;
    let items = max_q_len.max(1) * group;
    let nq = if items <= 1 {
        1
    } else if items <= 2 {
        2
    } else if items <= 4 {
        4
    } else {
        8
    };
    // Tensor-core path for bf16/f16 with many query items per row, unless SIMT is chosen. It
    // runs pipelined (cp.async double buffering, ldmatrix fragments: `paged_attn_mma_pipe_*`),
    // measured faster on the H200; `AttentionKernels::Unpipelined` selects the synchronous-load
    // variant (`paged_attn_mma_*`).
    let kernels = super::attention_kernels();
    let mma = matches!(dtype, DType::BF16 | DType::F16) && items >= MMA_MIN_ITEMS && kernels != super::AttentionKernels::Simt;
    let pipe = mma && kernels != super::AttentionKernels::Unpipelined;
    let p = Params {
        mma,
        pipe,
        tokens,
        heads,
        hd,
        kv_heads,
        block_size,
        rows,
        max_blocks,
        max_context_len,
        nq,
        scale_log2: scale * std::f32::consts::LOG2_E,
        mask_block,
    };
    let t = Inputs { q: &q, k: k_cache, v: v_cache, bt: block_tables, cl: context_lens, cu: cu_q_lens };
    match dtype {
        DType::BF16 => launch::<bf16>(&dev, "bf16", &t, &p),
        DType::F16 => launch::<f16>(&dev, "f16", &t, &p),
        DType::F32 => launch::<f32>(&dev, "f32", &t, &p),
        d => bail!("paged attention (cuda): dtype {d:?} not supported"),
    }
}

struct Inputs<'a> {
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    bt: &'a Tensor,
    cl: &'a Tensor,
    cu: &'a Tensor,
}

struct Params {
    mma: bool,
    /// Tensor-core path: the pipelined variant.
    pipe: bool,
    tokens: usize,
    heads: usize,
    hd: usize,
    kv_heads: usize,
    block_size: usize,
    rows: usize,
    max_blocks: usize,
    max_context_len: usize,
    nq: usize,
    scale_log2: f32,
    /// 0 bidirectional, 1 causal, B block-causal (see the kernel's header).
    mask_block: u32,
}

/// A contiguous view of `storage` at `layout`, checked for dtype and (for vector loads) alignment.
fn view<'a, T: CudaDType + DeviceRepr>(storage: &'a Storage, layout: &Layout, name: &str, align16: bool) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = storage else {
        bail!("paged attention (cuda): {name} is not a CUDA tensor");
    };
    if !layout.is_contiguous() {
        bail!("paged attention (cuda): {name} must be contiguous");
    }
    let start = layout.start_offset();
    if align16 && (start * std::mem::size_of::<T>()) % 16 != 0 {
        bail!("paged attention (cuda): {name} starts at element {start}, not 16-byte aligned");
    }
    let slice = cs.as_cuda_slice::<T>()?;
    Ok(slice.slice(start..start + layout.shape().elem_count()))
}

fn launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, name: &str, t: &Inputs, p: &Params) -> Result<Tensor> {
    let (qs, ql) = t.q.storage_and_layout();
    let (ks, kl) = t.k.storage_and_layout();
    let (vs, vl) = t.v.storage_and_layout();
    let (bts, btl) = t.bt.storage_and_layout();
    let (cls, cll) = t.cl.storage_and_layout();
    let (cus, cul) = t.cu.storage_and_layout();
    let q = view::<T>(&qs, ql, "q", true)?;
    let k = view::<T>(&ks, kl, "k_cache", true)?;
    let v = view::<T>(&vs, vl, "v_cache", true)?;
    let bt = view::<u32>(&bts, btl, "block_tables", false)?;
    let cl = view::<u32>(&cls, cll, "context_lens", false)?;
    let cu = view::<u32>(&cus, cul, "cu_q_lens", false)?;

    let group = p.heads / p.kv_heads;
    let n_out = p.tokens * p.heads * p.hd;
    let bs_shift: i32 = if p.block_size.is_power_of_two() { p.block_size.trailing_zeros() as i32 } else { -1 };
    let (num_rows, max_blocks, heads, kv_heads, block_size) = (p.rows as i32, p.max_blocks as i32, p.heads as i32, p.kv_heads as i32, p.block_size as i32);
    let (mask_block, tokens) = (p.mask_block as i32, p.tokens as i32);
    let scale_log2 = p.scale_log2;
    if p.mma {
        let tiles = (p.tokens * group + p.rows * (MMA_NQ - 1)) / MMA_NQ;
        // SAFETY: every element is written by the kernel (cu_q_lens[R] == T covers every token).
        let mut out = unsafe { dev.alloc::<T>(n_out)? };
        let kernel = if p.pipe { "paged_attn_mma_pipe" } else { "paged_attn_mma" };
        let func = dev.get_or_load_custom_func(&format!("{kernel}_{name}_d{}", p.hd), PA_MODULE, ptx::PAGED_ATTENTION)?;
        let cfg = LaunchConfig { grid_dim: (tiles as u32, p.kv_heads as u32, 1), block_dim: ((NW * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = func.builder();
        b.arg(&mut out).arg(&q).arg(&k).arg(&v).arg(&bt).arg(&cl).arg(&cu);
        b.arg(&num_rows).arg(&max_blocks).arg(&heads).arg(&kv_heads).arg(&block_size).arg(&bs_shift);
        b.arg(&scale_log2).arg(&mask_block);
        // SAFETY: argument list matches `paged_attn_mma_*` / `paged_attn_mma_pipe_*` in paged_attention.cu.
        unsafe { b.launch(cfg) }.w()?;
        let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
        return Ok(Tensor::from_storage(Storage::Cuda(storage), (p.tokens, p.heads, p.hd), BackpropOp::none(), false));
    }
    let nq = p.nq;
    // Tiles of nq query items per kv head: see the row search in the kernel.
    let tiles = (p.tokens * group + p.rows * (nq - 1)) / nq;
    if tiles > i32::MAX as usize {
        bail!("paged attention (cuda): too many query tiles");
    }
    let base_blocks = tiles * p.kv_heads;
    let mut splits = 1usize;
    if base_blocks < TARGET_BLOCKS && p.max_context_len >= 512 {
        splits = TARGET_BLOCKS.div_ceil(base_blocks).min(p.max_context_len / 256).clamp(1, 32);
    }
    let chunk = if splits == 1 {
        i32::MAX as usize
    } else {
        // A multiple of one block step (NW warps x up to 16 keys).
        p.max_context_len.div_ceil(splits).div_ceil(NW * 16) * (NW * 16)
    };
    let splits = if splits == 1 { 1 } else { p.max_context_len.div_ceil(chunk) };

    // SAFETY: every element is written by the kernels (cu_q_lens[R] == T covers every token).
    let mut out = unsafe { dev.alloc::<T>(n_out)? };
    let func = dev.get_or_load_custom_func(&format!("paged_attn_{name}_d{}_q{nq}", p.hd), PA_MODULE, ptx::PAGED_ATTENTION)?;
    let cfg = LaunchConfig { grid_dim: (tiles as u32, p.kv_heads as u32, splits as u32), block_dim: ((NW * 32) as u32, 1, 1), shared_mem_bytes: 0 };
    let (nsplits, chunk) = (splits as i32, chunk as i32);
    let null = 0u64;
    let ws = if splits > 1 {
        // SAFETY: the attention kernel writes every (split, token, head) entry it covers, and
        // the combine kernel reads only those.
        let acc = unsafe { dev.alloc::<f32>(splits * n_out)? };
        let ml = unsafe { dev.alloc::<f32>(splits * p.tokens * p.heads * 2)? };
        Some((acc, ml))
    } else {
        None
    };
    {
        let mut b = func.builder();
        b.arg(&mut out);
        match &ws {
            Some((acc, ml)) => {
                b.arg(acc);
                b.arg(ml);
            }
            None => {
                b.arg(&null);
                b.arg(&null);
            }
        }
        b.arg(&q).arg(&k).arg(&v).arg(&bt).arg(&cl).arg(&cu);
        b.arg(&num_rows).arg(&max_blocks).arg(&heads).arg(&kv_heads).arg(&block_size).arg(&bs_shift);
        b.arg(&scale_log2).arg(&mask_block).arg(&nsplits).arg(&chunk).arg(&tokens);
        // SAFETY: argument list matches `paged_attn_*` in paged_attention.cu; sizes checked above.
        unsafe { b.launch(cfg) }.w()?;
    }
    if let Some((acc, ml)) = &ws {
        let func = dev.get_or_load_custom_func(&format!("paged_attn_combine_{name}_d{}", p.hd), PA_MODULE, ptx::PAGED_ATTENTION)?;
        let cfg = LaunchConfig { grid_dim: (p.tokens as u32, p.heads as u32, 1), block_dim: (p.hd as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = func.builder();
        b.arg(&mut out).arg(acc).arg(ml).arg(&nsplits).arg(&tokens).arg(&heads);
        // SAFETY: matches `paged_attn_combine_*`; the workspace holds splits x T x H entries.
        unsafe { b.launch(cfg) }.w()?;
    }
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Ok(Tensor::from_storage(Storage::Cuda(storage), (p.tokens, p.heads, p.hd), BackpropOp::none(), false))
}

// ---------------------------------------------------------------------------------------------
// Fused per-layer ops (`src/ops/kernels/fused.cu`); entry points in `crate::ops::fused`.

const FUSED_MODULE: &str = "ponder_fused";

fn cuda_dev(t: &Tensor, op: &str) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        d => bail!("{op} (cuda): input is on {d:?}"),
    }
}

/// A contiguous view of a tensor's storage at its layout, checked for dtype.
fn op_view<'a, T: CudaDType + DeviceRepr>(storage: &'a Storage, layout: &Layout, op: &str, name: &str) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = storage else {
        bail!("{op} (cuda): {name} is not a CUDA tensor");
    };
    if !layout.is_contiguous() {
        bail!("{op} (cuda): {name} must be contiguous");
    }
    let start = layout.start_offset();
    let slice = cs.as_cuda_slice::<T>()?;
    Ok(slice.slice(start..start + layout.shape().elem_count()))
}

fn wrap<T: CudaDType + DeviceRepr, S: Into<candle_core::Shape>>(
    out: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    dev: &CudaDevice,
    shape: S,
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

fn dtype_suffix(dtype: DType, op: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        d => bail!("{op} (cuda): dtype {d:?} not supported"),
    })
}

fn same_device_dtype(op: &str, dtype: DType, first: &Tensor, ts: &[(&str, &Tensor)]) -> Result<()> {
    for (name, t) in ts {
        if !t.device().same_device(first.device()) {
            bail!("{op} (cuda): {name} is on {:?}, not {:?}", t.device(), first.device());
        }
        if t.dtype() != dtype {
            bail!("{op} (cuda): {name} is {:?}, expected {dtype:?}", t.dtype());
        }
    }
    Ok(())
}

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
    const OP: &str = "qkv_rope_write";
    let dev = cuda_dev(qkv, OP)?;
    let dtype = qkv.dtype();
    if head_dim % 2 != 0 {
        bail!("{OP} (cuda): odd head dim {head_dim}");
    }
    let (tokens, num_slots) = check_qkv_rope(OP, qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim)?;
    let pairs = (heads + kv_heads) * (head_dim / 2) + kv_heads * (head_dim / 2);
    if pairs == 0 {
        bail!("{OP} (cuda): sizes out of range");
    }
    let suf = dtype_suffix(dtype, OP)?;
    if tokens == 0 {
        return Tensor::zeros((0, heads, head_dim), dtype, qkv.device());
    }
    match dtype {
        DType::BF16 => qkv_rope_launch::<bf16>(&dev, suf, qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim, num_slots, pairs),
        DType::F16 => qkv_rope_launch::<f16>(&dev, suf, qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim, num_slots, pairs),
        _ => qkv_rope_launch::<f32>(&dev, suf, qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim, num_slots, pairs),
    }
}

#[allow(clippy::too_many_arguments)]
fn qkv_rope_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    num_slots: usize,
    pairs: usize,
) -> Result<Tensor> {
    const OP: &str = "qkv_rope_write";
    let tokens = qkv.dim(0)?;
    let (qs, ql) = qkv.storage_and_layout();
    let (cs, cl) = cos.storage_and_layout();
    let (ss, sl) = sin.storage_and_layout();
    let (ks, kl) = k_cache.storage_and_layout();
    let (vs, vl) = v_cache.storage_and_layout();
    let (ms, ml) = slot_mapping.storage_and_layout();
    let qkv_v = op_view::<T>(&qs, ql, OP, "qkv")?;
    let cos_v = op_view::<T>(&cs, cl, OP, "cos")?;
    let sin_v = op_view::<T>(&ss, sl, OP, "sin")?;
    // The caches are written in place through views taken under the storage read lock (candle
    // keeps the write lock crate-private). The write is ordered by the stream: every use of the
    // KV store's tensors (attention reads, these writes) is queued on this device's one stream.
    let k_v = op_view::<T>(&ks, kl, OP, "k_cache")?;
    let v_v = op_view::<T>(&vs, vl, OP, "v_cache")?;
    let slots = op_view::<u32>(&ms, ml, OP, "slot_mapping")?;
    // SAFETY: every (token, head, dim) of q is written by the kernel (one thread per pair).
    let mut q_out = unsafe { dev.alloc::<T>(tokens * heads * head_dim)? };
    let func = dev.get_or_load_custom_func(&format!("qkv_rope_write_{suf}"), FUSED_MODULE, ptx::FUSED)?;
    const THREADS: usize = 256;
    let cfg = LaunchConfig { grid_dim: (tokens as u32, pairs.div_ceil(THREADS) as u32, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    let (h, kvh, hd, ns) = (heads as i32, kv_heads as i32, head_dim as i32, num_slots as i64);
    let mut b = func.builder();
    b.arg(&mut q_out).arg(&k_v).arg(&v_v).arg(&qkv_v).arg(&cos_v).arg(&sin_v).arg(&slots);
    b.arg(&h).arg(&kvh).arg(&hd).arg(&ns);
    // SAFETY: argument list matches `qkv_rope_write_*` in fused.cu; shapes checked by the caller.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(wrap(q_out, dev, (tokens, heads, head_dim)))
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
    let dev = cuda_dev(qkv, OP)?;
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
    let suf = dtype_suffix(dtype, OP)?;
    if tokens == 0 {
        let z = |h: usize| Tensor::zeros((0, h, head_dim), dtype, qkv.device());
        return Ok((z(heads)?, z(kv_heads)?, z(kv_heads)?));
    }
    let a = NormRopeArgs { qkv, qk_norm, eps, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim, num_slots };
    match dtype {
        DType::BF16 => norm_rope_launch::<bf16>(&dev, suf, &a),
        DType::F16 => norm_rope_launch::<f16>(&dev, suf, &a),
        _ => norm_rope_launch::<f32>(&dev, suf, &a),
    }
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
    let qkv_v = op_view::<T>(&qs, ql, OP, "qkv")?;
    let cos_v = op_view::<T>(&cs, cl, OP, "cos")?;
    let sin_v = op_view::<T>(&ss, sl, OP, "sin")?;
    // Caches written in place under the read lock, ordered by the device's one stream (see
    // `qkv_rope_launch`).
    let k_v = op_view::<T>(&ks, kl, OP, "k_cache")?;
    let v_v = op_view::<T>(&vs, vl, OP, "v_cache")?;
    let slots = op_view::<u32>(&ms, ml, OP, "slot_mapping")?;
    let qn_v = op_view::<T>(&qns, qnl, OP, "q_norm")?;
    let kn_v = op_view::<T>(&kns, knl, OP, "k_norm")?;
    let (h, kvh, hd) = (a.heads, a.kv_heads, a.head_dim);
    // SAFETY: one warp per (token, head) writes every element of q, k and v.
    let mut q_out = unsafe { dev.alloc::<T>(tokens * h * hd)? };
    let mut k_out = unsafe { dev.alloc::<T>(tokens * kvh * hd)? };
    let mut v_out = unsafe { dev.alloc::<T>(tokens * kvh * hd)? };
    let func = dev.get_or_load_custom_func(&format!("qkv_norm_rope_write_{suf}"), FUSED_MODULE, ptx::FUSED)?;
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

/// Copies row `r` of `src` `[rows, ..]` into row `index[r]` of `dst`, in place; `dst` is viewed
/// as rows of `src`'s row width (a paged cache `[blocks, block_size, kv_heads, head_dim]` as
/// `[blocks · block_size, kv_heads · head_dim]`). Indices past `dst`'s rows are skipped.
pub fn scatter_rows(dst: &Tensor, src: &Tensor, index: &Tensor) -> Result<()> {
    const OP: &str = "scatter_rows";
    let dev = cuda_dev(dst, OP)?;
    let dtype = dst.dtype();
    let src = src.to_dtype(dtype)?.contiguous()?;
    same_device_dtype(OP, dtype, dst, &[("src", &src)])?;
    if !index.device().same_device(dst.device()) || index.dtype() != DType::U32 {
        bail!("{OP} (cuda): index must be u32 on the device of dst");
    }
    if !dst.is_contiguous() || src.rank() == 0 {
        bail!("{OP} (cuda): dst must be contiguous and src have rows, got {:?} / {:?}", dst.dims(), src.dims());
    }
    let rows = src.dim(0)?;
    let width = if rows == 0 { 0 } else { src.elem_count() / rows };
    if index.dims() != [rows] || (width > 0 && dst.elem_count() % width != 0) {
        bail!("{OP} (cuda): src {:?} / index {:?} / dst {:?} do not agree", src.dims(), index.dims(), dst.dims());
    }
    if rows == 0 || width == 0 {
        return Ok(());
    }
    if width > i32::MAX as usize || rows > i32::MAX as usize {
        bail!("{OP} (cuda): sizes out of range");
    }
    let dst_rows = dst.elem_count() / width;
    let suf = dtype_suffix(dtype, OP)?;
    match dtype {
        DType::BF16 => scatter_rows_launch::<bf16>(&dev, suf, dst, &src, index, rows, width, dst_rows),
        DType::F16 => scatter_rows_launch::<f16>(&dev, suf, dst, &src, index, rows, width, dst_rows),
        _ => scatter_rows_launch::<f32>(&dev, suf, dst, &src, index, rows, width, dst_rows),
    }
}

#[allow(clippy::too_many_arguments)]
fn scatter_rows_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    dst: &Tensor,
    src: &Tensor,
    index: &Tensor,
    rows: usize,
    width: usize,
    dst_rows: usize,
) -> Result<()> {
    const OP: &str = "scatter_rows";
    let (ds, dl) = dst.storage_and_layout();
    let (ss, sl) = src.storage_and_layout();
    let (is, il) = index.storage_and_layout();
    // Written in place under the read lock, ordered by the device's one stream (see
    // `qkv_rope_launch`).
    let dst_v = op_view::<T>(&ds, dl, OP, "dst")?;
    let src_v = op_view::<T>(&ss, sl, OP, "src")?;
    let index_v = op_view::<u32>(&is, il, OP, "index")?;
    let func = dev.get_or_load_custom_func(&format!("scatter_rows_{suf}"), FUSED_MODULE, ptx::FUSED)?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let (w, n) = (width as i32, dst_rows as i64);
    let mut b = func.builder();
    b.arg(&dst_v).arg(&src_v).arg(&index_v).arg(&w).arg(&n);
    // SAFETY: argument list matches `scatter_rows_*` in fused.cu; indices are bounded in-kernel.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Greedy token `[rows]` u32 and its softmax probability `[rows]` f32 of each row of `logits`
/// `[rows, vocab]`, in one pass over the logits in their own dtype; `exclude` (the mask token)
/// is never chosen and left out of the normaliser.
pub fn greedy_confidence(logits: &Tensor, exclude: Option<u32>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "greedy_confidence";
    let dev = cuda_dev(logits, OP)?;
    let logits = logits.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if vocab == 0 || vocab > i32::MAX as usize || rows > i32::MAX as usize {
        bail!("{OP} (cuda): logits {:?}", logits.dims());
    }
    let dtype = logits.dtype();
    let suf = dtype_suffix(dtype, OP)?;
    if rows == 0 {
        return Ok((Tensor::zeros(0, DType::U32, logits.device())?, Tensor::zeros(0, DType::F32, logits.device())?));
    }
    let exclude = exclude.map_or(-1, |e| e as i32);
    match dtype {
        DType::BF16 => greedy_launch::<bf16>(&dev, suf, &logits, rows, vocab, exclude),
        DType::F16 => greedy_launch::<f16>(&dev, suf, &logits, rows, vocab, exclude),
        _ => greedy_launch::<f32>(&dev, suf, &logits, rows, vocab, exclude),
    }
}

fn greedy_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, logits: &Tensor, rows: usize, vocab: usize, exclude: i32) -> Result<(Tensor, Tensor)> {
    const OP: &str = "greedy_confidence";
    let (ls, ll) = logits.storage_and_layout();
    let l_v = op_view::<T>(&ls, ll, OP, "logits")?;
    // SAFETY: the kernel writes one token and one probability per row.
    let mut tokens = unsafe { dev.alloc::<u32>(rows)? };
    let mut conf = unsafe { dev.alloc::<f32>(rows)? };
    let func = dev.get_or_load_custom_func(&format!("greedy_confidence_{suf}"), FUSED_MODULE, ptx::FUSED)?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let v = vocab as i32;
    let mut b = func.builder();
    b.arg(&mut tokens).arg(&mut conf).arg(&l_v).arg(&v).arg(&exclude);
    // SAFETY: argument list matches `greedy_confidence_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok((wrap(tokens, dev, rows), wrap(conf, dev, rows)))
}

const FOCUS_MODULE: &str = "ponder_focus";

/// FOCUS importance of each row's masked tokens (see `kernels/focus.cu`): `q` `[T, H, D]`, `k`
/// `[T, KV, D]` of the launch's tokens, `gather` `[R * m]` u32 token indices of each row's
/// masked tokens padded to `m` (at most 32), `lens` `[R]` u32 → `[R, m]` f32, rounded through
/// the dtype of `q`. Deterministic (fixed summation order).
pub fn focus_importance(q: &Tensor, k: &Tensor, gather: &Tensor, lens: &Tensor, m: usize) -> Result<Tensor> {
    const OP: &str = "focus_importance";
    let dev = cuda_dev(q, OP)?;
    let dtype = q.dtype();
    let (q, k) = (q.contiguous()?, k.to_dtype(dtype)?.contiguous()?);
    same_device_dtype(OP, dtype, &q, &[("k", &k)])?;
    let (_, heads, d) = q.dims3()?;
    let (_, kvh, dk) = k.dims3()?;
    let rows = lens.dim(0)?;
    if dk != d || kvh == 0 || heads % kvh != 0 || d > 128 || m > 32 || gather.dims() != [rows * m] {
        bail!("{OP} (cuda): q {:?}, k {:?}, gather {:?} for {rows} rows of {m} (head dim <= 128, m <= 32)", q.dims(), k.dims(), gather.dims());
    }
    for (name, t) in [("gather", gather), ("lens", lens)] {
        if t.dtype() != DType::U32 || !t.device().same_device(q.device()) {
            bail!("{OP} (cuda): {name} must be u32 on the device of q");
        }
    }
    if rows == 0 || m == 0 {
        return Tensor::zeros((rows, m), DType::F32, q.device());
    }
    let suf = dtype_suffix(dtype, OP)?;
    match dtype {
        DType::BF16 => focus_launch::<bf16>(&dev, suf, &q, &k, gather, lens, rows, m, heads, kvh, d),
        DType::F16 => focus_launch::<f16>(&dev, suf, &q, &k, gather, lens, rows, m, heads, kvh, d),
        _ => focus_launch::<f32>(&dev, suf, &q, &k, gather, lens, rows, m, heads, kvh, d),
    }
}

#[allow(clippy::too_many_arguments)]
fn focus_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    q: &Tensor,
    k: &Tensor,
    gather: &Tensor,
    lens: &Tensor,
    rows: usize,
    m: usize,
    heads: usize,
    kvh: usize,
    d: usize,
) -> Result<Tensor> {
    const OP: &str = "focus_importance";
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (gs, gl) = gather.storage_and_layout();
    let (ls, ll) = lens.storage_and_layout();
    let q_v = op_view::<T>(&qs, ql, OP, "q")?;
    let k_v = op_view::<T>(&ks, kl, OP, "k")?;
    let g_v = op_view::<u32>(&gs, gl, OP, "gather")?;
    let l_v = op_view::<u32>(&ls, ll, OP, "lens")?;
    // SAFETY: pass 1 writes every element of [rows, heads, m], pass 2 every element of [rows, m].
    let mut partial = unsafe { dev.alloc::<f32>(rows * heads * m)? };
    let mut out = unsafe { dev.alloc::<f32>(rows * m)? };
    let (mm, h, g, dd, scale) = (m as i32, heads as i32, kvh as i32, d as i32, 1.0f32 / (d as f32).sqrt());
    let func = dev.get_or_load_custom_func(&format!("focus_importance_heads_{suf}"), FOCUS_MODULE, ptx::FOCUS)?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, heads as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    b.arg(&mut partial).arg(&q_v).arg(&k_v).arg(&g_v).arg(&l_v).arg(&mm).arg(&h).arg(&g).arg(&dd).arg(&scale);
    // SAFETY: argument list matches `focus_importance_heads_*` in focus.cu; sizes checked by the caller.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    let func = dev.get_or_load_custom_func(&format!("focus_importance_sum_{suf}"), FOCUS_MODULE, ptx::FOCUS)?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    b.arg(&mut out).arg(&partial).arg(&l_v).arg(&mm).arg(&h);
    // SAFETY: argument list matches `focus_importance_sum_*` in focus.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(wrap(out, dev, (rows, m)))
}

/// `(h2, n) = (residual + rms_norm(x, w_x), rms_norm(h2, w_next))` over the last dim, in one
/// launch. `residual`, `x` `[.., C]` and the weights `[C]` share one dtype; f32 statistics.
pub fn add_rms_norm(residual: &Tensor, x: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    const OP: &str = "add_rms_norm";
    let dev = cuda_dev(x, OP)?;
    let dtype = x.dtype();
    same_device_dtype(OP, dtype, x, &[("residual", residual), ("w_x", w_x), ("w_next", w_next)])?;
    if residual.dims() != x.dims() {
        bail!("{OP} (cuda): residual {:?} vs x {:?}", residual.dims(), x.dims());
    }
    let ncols = x.dim(candle_core::D::Minus1)?;
    if w_x.dims1()? != ncols || w_next.dims1()? != ncols {
        bail!("{OP} (cuda): weights {:?} / {:?} for {ncols} columns", w_x.dims(), w_next.dims());
    }
    let rows = x.elem_count() / ncols.max(1);
    if ncols == 0 || rows == 0 {
        return Ok((residual.clone(), x.zeros_like()?));
    }
    if ncols > i32::MAX as usize || rows > u32::MAX as usize / 2 {
        bail!("{OP} (cuda): sizes out of range");
    }
    let suf = dtype_suffix(dtype, OP)?;
    let residual = residual.contiguous()?;
    let x = x.contiguous()?;
    let (w_x, w_next) = (w_x.contiguous()?, w_next.contiguous()?);
    match dtype {
        DType::BF16 => add_rms_launch::<bf16>(&dev, suf, &residual, &x, &w_x, &w_next, rows, ncols, eps),
        DType::F16 => add_rms_launch::<f16>(&dev, suf, &residual, &x, &w_x, &w_next, rows, ncols, eps),
        _ => add_rms_launch::<f32>(&dev, suf, &residual, &x, &w_x, &w_next, rows, ncols, eps),
    }
}

#[allow(clippy::too_many_arguments)]
fn add_rms_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    residual: &Tensor,
    x: &Tensor,
    w_x: &Tensor,
    w_next: &Tensor,
    rows: usize,
    ncols: usize,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "add_rms_norm";
    let (rs, rl) = residual.storage_and_layout();
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w_x.storage_and_layout();
    let (ns, nl) = w_next.storage_and_layout();
    let r_v = op_view::<T>(&rs, rl, OP, "residual")?;
    let x_v = op_view::<T>(&xs, xl, OP, "x")?;
    let w_v = op_view::<T>(&ws, wl, OP, "w_x")?;
    let n_v = op_view::<T>(&ns, nl, OP, "w_next")?;
    // SAFETY: the kernel writes every element of both outputs (one block per row).
    let mut h_out = unsafe { dev.alloc::<T>(rows * ncols)? };
    let mut n_out = unsafe { dev.alloc::<T>(rows * ncols)? };
    let func = dev.get_or_load_custom_func(&format!("add_rms_norm_{suf}"), FUSED_MODULE, ptx::FUSED)?;
    // ~8 columns per thread, a multiple of 32 threads, at most 1024.
    let threads = ncols.div_ceil(8).next_power_of_two().clamp(32, 1024);
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 };
    let nc = ncols as i32;
    let mut b = func.builder();
    b.arg(&mut h_out).arg(&mut n_out).arg(&r_v).arg(&x_v).arg(&w_v).arg(&n_v);
    b.arg(&nc).arg(&eps);
    // SAFETY: argument list matches `add_rms_norm_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    let shape = x.shape().clone();
    Ok((wrap(h_out, dev, shape.clone()), wrap(n_out, dev, shape)))
}

/// `silu(gate) * up` for `gate_up` `[.., 2I]` (gate first), output `[.., I]`, one launch.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    const OP: &str = "silu_mul";
    let dev = cuda_dev(gate_up, OP)?;
    let dtype = gate_up.dtype();
    let suf = dtype_suffix(dtype, OP)?;
    let two_i = gate_up.dim(candle_core::D::Minus1)?;
    if two_i % 2 != 0 {
        bail!("{OP} (cuda): last dim {two_i} is odd");
    }
    let inter = two_i / 2;
    let mut dims = gate_up.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = inter;
    let rows = gate_up.elem_count() / two_i.max(1);
    if rows * inter == 0 {
        return Tensor::zeros(dims, dtype, gate_up.device());
    }
    let gate_up = gate_up.contiguous()?;
    match dtype {
        DType::BF16 => silu_mul_launch::<bf16>(&dev, suf, &gate_up, rows, inter, dims),
        DType::F16 => silu_mul_launch::<f16>(&dev, suf, &gate_up, rows, inter, dims),
        _ => silu_mul_launch::<f32>(&dev, suf, &gate_up, rows, inter, dims),
    }
}

fn silu_mul_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, gate_up: &Tensor, rows: usize, inter: usize, dims: Vec<usize>) -> Result<Tensor> {
    const OP: &str = "silu_mul";
    let (gs, gl) = gate_up.storage_and_layout();
    let g_v = op_view::<T>(&gs, gl, OP, "gate_up")?;
    let n = rows * inter;
    // SAFETY: the grid-stride loop writes every output element.
    let mut out = unsafe { dev.alloc::<T>(n)? };
    let func = dev.get_or_load_custom_func(&format!("silu_mul_{suf}"), FUSED_MODULE, ptx::FUSED)?;
    const THREADS: usize = 256;
    let cfg = LaunchConfig { grid_dim: (n.div_ceil(THREADS).min(132 * 16) as u32, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    let (r, i) = (rows as i64, inter as i32);
    if inter > i32::MAX as usize {
        bail!("{OP} (cuda): intermediate size out of range");
    }
    let mut b = func.builder();
    b.arg(&mut out).arg(&g_v).arg(&r).arg(&i);
    // SAFETY: argument list matches `silu_mul_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(wrap(out, dev, dims))
}

/// Rows `index` of each of up to four `sources` `[T, ..]` of one dtype, in one launch (see
/// `compact_rows_*` in fused.cu). Indices were checked against `T` by the caller.
pub fn compact_rows(sources: &[&Tensor], index: &[u32]) -> Result<Vec<Tensor>> {
    const OP: &str = "compact_rows";
    let Some(first) = sources.first() else {
        return Ok(vec![]);
    };
    if sources.len() > 4 {
        bail!("{OP} (cuda): at most four sources, got {}", sources.len());
    }
    let dtype = first.dtype();
    let dev = cuda_dev(first, OP)?;
    let srcs = sources.iter().map(|s| s.contiguous()).collect::<Result<Vec<_>>>()?;
    let named: Vec<(&str, &Tensor)> = srcs.iter().map(|s| ("source", s)).collect();
    same_device_dtype(OP, dtype, first, &named)?;
    let suf = dtype_suffix(dtype, OP)?;
    match dtype {
        DType::BF16 => compact_launch::<bf16>(&dev, suf, &srcs, index),
        DType::F16 => compact_launch::<f16>(&dev, suf, &srcs, index),
        _ => compact_launch::<f32>(&dev, suf, &srcs, index),
    }
}

fn compact_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, srcs: &[Tensor], index: &[u32]) -> Result<Vec<Tensor>> {
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    const OP: &str = "compact_rows";
    let rows = srcs[0].dim(0)?;
    let n = index.len();
    let shapes: Vec<Vec<usize>> = srcs.iter().map(|s| std::iter::once(n).chain(s.dims()[1..].iter().copied()).collect()).collect();
    let widths: Vec<usize> = srcs.iter().map(|s| s.elem_count() / rows.max(1)).collect();
    if n == 0 || rows == 0 {
        return shapes.into_iter().map(|s| Tensor::zeros(s, srcs[0].dtype(), srcs[0].device())).collect();
    }
    if n > i32::MAX as usize || widths.iter().any(|&w| w > i32::MAX as usize) {
        bail!("{OP} (cuda): sizes out of range");
    }
    let stream = dev.cuda_stream();
    let idx = dev.clone_htod(index)?;
    // SAFETY: the kernel writes every element of each output ([n, width]).
    let mut outs = widths.iter().map(|&w| unsafe { dev.alloc::<T>(n * w) }).collect::<Result<Vec<_>>>()?;
    let storages: Vec<_> = srcs.iter().map(|s| s.storage_and_layout()).collect();
    let views = storages.iter().map(|(st, l)| op_view::<T>(st, l, OP, "source")).collect::<Result<Vec<_>>>()?;
    // Raw pointers so that unused slots (width 0, never dereferenced) can repeat the first.
    let (mut src_ptrs, mut dst_ptrs, mut syncs_r, mut syncs_w) = (vec![], vec![], vec![], vec![]);
    for v in &views {
        let (p, s) = v.device_ptr(&stream);
        src_ptrs.push(p);
        syncs_r.push(s);
    }
    for o in outs.iter_mut() {
        let (p, s) = o.device_ptr_mut(&stream);
        dst_ptrs.push(p);
        syncs_w.push(s);
    }
    let w: Vec<i32> = (0..4).map(|i| widths.get(i).map_or(0, |&w| w as i32)).collect();
    let sp: Vec<u64> = (0..4).map(|i| *src_ptrs.get(i).unwrap_or(&src_ptrs[0])).collect();
    let dp: Vec<u64> = (0..4).map(|i| *dst_ptrs.get(i).unwrap_or(&dst_ptrs[0])).collect();
    let total_rows = rows as i64;
    let func = dev.get_or_load_custom_func(&format!("compact_rows_{suf}"), FUSED_MODULE, ptx::FUSED)?;
    let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    for i in 0..4 {
        b.arg(&dp[i]).arg(&sp[i]).arg(&w[i]);
    }
    b.arg(&idx).arg(&total_rows);
    // SAFETY: argument list matches `compact_rows_*` in fused.cu; pointers address live
    // allocations of the widths passed, ordered on the device's one stream.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    drop((syncs_r, syncs_w));
    Ok(outs.into_iter().zip(shapes).map(|(o, s)| wrap(o, dev, s)).collect())
}
