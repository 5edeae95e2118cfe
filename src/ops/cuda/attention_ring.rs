//! Decode attention through the bulk-copy ring kernel (`paged_decode_ring_*` in
//! `kernels/paged_attention.cu`): when it takes a launch, and the launch itself with its combine.

use super::attention::{Params, RopeViews, MMA_MIN_ITEMS};
use super::launch::{compute_major, kernel, sm_count, Dest, Module};
use crate::ops::policy::{AttentionKernels, DecodeRing, KernelPolicy};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, DType, Result};

/// Decode ring kernel (`paged_decode_ring_*`): positions a stage, stages in flight a block (64 KB
/// of K/V at 16 kv heads), blocks an SM in its grid, fewest stages a block takes (so that small
/// launches do not spread over blocks that each wait out a copy's latency for a few keys), the
/// fewest rows `Auto` sends through it, most query heads a block (two a consumer warp, eight
/// consumer warps), the head dim it is built for. Grid, depth and fewest stages are the best of a
/// sweep on the H200. Below RING_MIN_ROWS the SIMT kernel (a block per row and head) was faster
/// there. With `qkv_rope_write` folded in
/// (`qkv_rope_paged_attention`) the ring saves a launch, which moves its break-even down:
/// RING_ROPE_MIN_ROWS — an Ouro-1.4B CB step at 32 rows 4 % shorter than `qkv_rope_write` + the
/// split SIMT plan. The SIMT kernel folds that write in too, and its 8-warp build
/// held to four blocks an SM walks a 32-row launch unsplit: folded launches of at most
/// SIMT_FOLD_MAX_ROWS rows under a context bound of at most SIMT_FOLD_MAX_KEYS stay on the SIMT
/// fold — the graphs' 32-row bucket of a CB step at prompt 128 (bound 512) 6 % shorter than on the
/// ring at 24 rows, level at 32. Longer bounds keep the ring there: the dense build
/// is not measured on them (alone, at 2k keys and two blocks an SM, it was 24 % slower than the
/// split plan), and at prompt 2048 the ring was 8 % faster at 24 rows.
const RING_CP: usize = 4;
const RING_DEPTH: usize = 2;
const RING_BLOCKS_PER_SM: usize = 1;
const RING_MIN_CHUNK: usize = 8;
const RING_MIN_ROWS: usize = 64;
const RING_ROPE_MIN_ROWS: usize = 32;
const SIMT_FOLD_MAX_ROWS: usize = 32;
const SIMT_FOLD_MAX_KEYS: usize = 512;
const RING_MAX_HEADS: usize = 16;
const RING_HD: usize = 128;
/// Dynamic shared memory the ring kernel is opted into: the most any launch asks (16 kv heads of
/// 2-byte elements), set alike by every launch so that concurrent callers cannot lower it under
/// each other.
const RING_MAX_SMEM: usize = RING_DEPTH * 2 * RING_CP * RING_MAX_HEADS * RING_HD * 2;

/// Whether a decode launch of `rows` rows under a context bound of `max_ctx` keys goes through the
/// ring: always with [`AttentionKernels::DecodeRing`] or [`DecodeRing::Always`]; with `Auto` and
/// [`DecodeRing::ByWidth`] from RING_MIN_ROWS rows on (for the ring that folds in
/// `qkv_rope_write`, `folded`: from RING_ROPE_MIN_ROWS, except launches the SIMT fold keeps —
/// see SIMT_FOLD_MAX_ROWS).
fn ring_selected(policy: &KernelPolicy, rows: usize, max_ctx: usize, folded: bool) -> bool {
    match (policy.attention, policy.decode_ring) {
        (AttentionKernels::DecodeRing, _) | (AttentionKernels::Auto, DecodeRing::Always) => true,
        (AttentionKernels::Auto, DecodeRing::ByWidth) => {
            if folded {
                rows >= RING_ROPE_MIN_ROWS && !(rows <= SIMT_FOLD_MAX_ROWS && max_ctx <= SIMT_FOLD_MAX_KEYS)
            } else {
                rows >= RING_MIN_ROWS
            }
        }
        _ => false,
    }
}

/// Whether the decode ring (`folded`: with `qkv_rope_write` folded in) takes a launch of
/// `[tokens, rows, max_q_len, heads, kv_heads, head_dim, block_size, max_context_len]`: decode
/// rows (one query each: max_q_len 1 and as many tokens as rows), bf16 / f16, head dim 128, 1 to
/// 16 query heads in GQA groups too small for the tensor-core kernel (which takes those first),
/// whole stages in a page, and the ring selected, built and run by `dev`.
pub(super) fn ring_takes(dev: &CudaDevice, policy: &KernelPolicy, dtype: DType, shape: [usize; 8], folded: bool) -> Result<bool> {
    let [tokens, rows, max_q_len, heads, kv_heads, hd, block_size, max_ctx] = shape;
    Ok(ring_selected(policy, rows, max_ctx, folded)
        && heads > 0
        && kv_heads > 0
        && heads / kv_heads * max_q_len < MMA_MIN_ITEMS
        && max_q_len == 1
        && tokens == rows
        && matches!(dtype, DType::BF16 | DType::F16)
        && hd == RING_HD
        && heads <= RING_MAX_HEADS
        && block_size % RING_CP == 0
        && ring_available(dev)?)
}

/// Whether the decode ring kernel can run on `dev`: PTX built for sm_90 or later (it uses bulk
/// copies and mbarriers) and a device that runs it.
fn ring_available(dev: &CudaDevice) -> Result<bool> {
    Ok(cfg!(ponder_bulk_copy) && compute_major(dev)? >= 9)
}

/// Decode attention through the bulk-copy ring (`paged_decode_ring_*`, see the kernel's header):
/// a grid of RING_BLOCKS_PER_SM blocks an SM that cut the launch's keys into equal runs, one
/// producer warp and one consumer warp per two query heads a block, then
/// `paged_decode_ring_combine_*` (the same grid, a warp a head) for the rows whose keys more than
/// one block walked and the rows without keys.
pub(super) fn launch_ring<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    name: &str,
    p: &Params,
    [q, k, v]: [&CudaView<T>; 3],
    [bt, cl, cu]: [&CudaView<u32>; 3],
    rope: Option<&RopeViews<T>>,
    (out, acc, ml, own): (&mut Dest<T>, &mut Dest<f32>, &mut Dest<f32>, &mut Dest<u32>),
) -> Result<()> {
    let grid = ring_grid(dev)?;
    let smem = RING_DEPTH * 2 * RING_CP * p.kv_heads * p.hd * std::mem::size_of::<T>();
    let kernel = if rope.is_some() { "paged_decode_ring_rope" } else { "paged_decode_ring" };
    let func = kernel!(dev, Module::PagedAttention, &format!("{kernel}_{name}_d{RING_HD}"))?;
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, RING_MAX_SMEM as i32).w()?;
    let threads = (p.heads.div_ceil(2) + 1) * 32;
    let cfg = LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: smem as u32 };
    // The output and workspace come from the caller: partial (row r, block b) lives in slot
    // b + r of `acc` / `ml` (grid + rows slots), `own` holds an entry of 4 a block.
    let (rows, max_blocks, heads, kv_heads, block_size, depth, min_chunk) =
        (p.rows as i32, p.max_blocks as i32, p.heads as i32, p.kv_heads as i32, p.block_size as i32, RING_DEPTH as i32, RING_MIN_CHUNK as i32);
    {
        let mut b = func.builder();
        out.push(&mut b);
        acc.push(&mut b);
        ml.push(&mut b);
        own.push(&mut b);
        b.arg(q).arg(k).arg(v).arg(bt).arg(cl).arg(cu);
        b.arg(&rows).arg(&max_blocks).arg(&heads).arg(&kv_heads).arg(&block_size).arg(&p.scale_log2).arg(&depth).arg(&min_chunk);
        if let Some(r) = rope {
            b.arg(q).arg(&r.cos).arg(&r.sin).arg(&r.slots).arg(&r.num_slots);
        }
        // SAFETY: argument list matches `paged_decode_ring_*` (or, with `rope`,
        // `paged_decode_ring_rope_*`) in paged_attention.cu; the caller checked one query a row,
        // head dim 128, heads <= 16 and block_size % RING_CP == 0 (with `rope`: the qkv, cos / sin
        // and slot shapes and 16-byte aligned starts), and the workspace holds grid + rows slots.
        unsafe { b.launch(cfg) }.w()?;
    }
    crate::ops::policy::count(|c| {
        c.decode_ring += 1;
        c.decode_ring_rope += u64::from(rope.is_some());
    });
    let func = kernel!(dev, Module::PagedAttention, &format!("paged_decode_ring_combine_{name}_d{RING_HD}"))?;
    let cfg = LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (32 * p.heads as u32, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    out.push(&mut b);
    acc.push(&mut b);
    ml.push(&mut b);
    own.push(&mut b);
    b.arg(cl).arg(cu).arg(&rows).arg(&heads);
    // SAFETY: matches `paged_decode_ring_combine_*`; reads the partials and entries written above.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Blocks in the ring kernel's grid on `dev`.
pub(super) fn ring_grid(dev: &CudaDevice) -> Result<usize> {
    Ok(RING_BLOCKS_PER_SM * sm_count(dev)?)
}

/// Elements of the workspace parts (`acc`, `ml`, `own`) a decode launch of up to `rows` rows
/// and `heads` query heads of dim `hd` needs on `dev`: the ring's partials (one a grid block and
/// one a row), or the SIMT kernel's key splits (at most `MAX_ATTENTION_SPLITS` partials a token), whichever
/// is more. Sized for the splits' worst case, a graph on the arena allocates nothing whatever
/// the plan: a GQA launch of 40 rows at a 512-key bound cuts 8 splits, 320 partials against the
/// ring's 172 on 132 SMs.
pub fn attention_scratch_len(dev: &CudaDevice, rows: usize, heads: usize, hd: usize) -> Result<[usize; 3]> {
    let slots = (ring_grid(dev)? + rows).max(crate::ops::MAX_ATTENTION_SPLITS * rows);
    Ok([slots * heads * hd, slots * heads * 2, ring_grid(dev)? * 4])
}
