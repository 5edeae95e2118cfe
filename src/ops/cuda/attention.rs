//! Paged attention on CUDA (`kernels/paged_attention.cu`): SIMT kernels with a split-K
//! combine for few query items per row, tensor-core kernels (pipelined by default) for many;
//! decode launches the bulk-copy ring takes go to `attention_ring.rs`.

use super::attention_ring::{launch_ring, ring_takes};
use super::launch::{device, for_float, kernel, sm_count, view, Dest, Module};
use crate::ops::attention_split::{self, keys_per_warp_step, Cut, SimtBuild};
use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// Names this op in errors.
const OP: &str = "paged attention";
/// Warps per thread block of the attention kernels' 4-warp builds (`NW` in the .cu file): the
/// tensor-core kernel and the SIMT builds whose steps the split plans count.
const NW: usize = 4;
/// Query items (token x head of a GQA group) per row from which the tensor-core kernel is used.
pub(super) const MMA_MIN_ITEMS: usize = 16;
/// Query items per block of the tensor-core kernel (`MMA_NQ` in the .cu file).
const MMA_NQ: usize = 64;

/// Paged attention on CUDA; see [`crate::ops::paged_attention`] for the semantics.
///
/// `q` `[T, H, D]`; caches `[num_blocks, block_size, kv_heads, D]` (contiguous, dtype of `q`);
/// `block_tables` `[R, max_blocks]` u32; `context_lens` `[R]` u32; `cu_q_lens` `[R + 1]` u32 with
/// `cu_q_lens[R] == T`. Keys are read in place through the block table. Output `[T, H, D]`, dtype
/// of `q`. `max_q_len` picks the query tile and must be at least every row's query count (the
/// decode ring reads one query a row when it is 1); `max_context_len` only sizes the key split (it
/// must be at least every row's context length).
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
    paged_attention_to(q, k_cache, v_cache, [block_tables, context_lens, cu_q_lens], max_q_len, max_context_len, scale, mask_block, None)
}

/// [`paged_attention`] with its output and split workspace given (`into.out` `[T, H, D]` of q's
/// dtype, contiguous).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_into(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    tables: [&Tensor; 3],
    max_q_len: usize,
    max_context_len: usize,
    scale: f32,
    mask_block: u32,
    into: &AttentionInto,
) -> Result<()> {
    paged_attention_to(q, k_cache, v_cache, tables, max_q_len, max_context_len, scale, mask_block, Some(into)).map(|_| ())
}

#[allow(clippy::too_many_arguments)]
fn paged_attention_to(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    [block_tables, context_lens, cu_q_lens]: [&Tensor; 3],
    max_q_len: usize,
    max_context_len: usize,
    scale: f32,
    mask_block: u32,
    into: Option<&AttentionInto>,
) -> Result<Tensor> {
    let dev = device(q, OP)?;
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
    if let Some(g) = into {
        super::launch::check_given(OP, "out", q, dtype, &[tokens, heads, hd], Some(g.out))?;
    }
    if tokens == 0 || rows == 0 {
        return match into {
            Some(g) => Ok(g.out.clone()),
            None => Tensor::zeros((tokens, heads, hd), dtype, q.device()),
        };
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
    let policy = crate::ops::policy::current();
    let kernels = policy.attention;
    let mma = matches!(dtype, DType::BF16 | DType::F16) && items >= MMA_MIN_ITEMS && kernels != crate::ops::AttentionKernels::Simt;
    let pipe = mma && kernels != crate::ops::AttentionKernels::Unpipelined;
    let ring = ring_takes(&dev, &policy, dtype, [tokens, rows, max_q_len, heads, kv_heads, hd, block_size, max_context_len], false)?;
    let p = Params {
        mma,
        pipe,
        ring,
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
    for_float!(dtype, OP, |T, suf| launch::<T>(&dev, suf, &t, &p, None, into))
}

struct Inputs<'a> {
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    bt: &'a Tensor,
    cl: &'a Tensor,
    cu: &'a Tensor,
}

pub(super) struct Params {
    mma: bool,
    /// Decode through the bulk-copy ring kernel.
    ring: bool,
    /// Tensor-core path: the pipelined variant.
    pipe: bool,
    pub(super) tokens: usize,
    pub(super) heads: usize,
    pub(super) hd: usize,
    pub(super) kv_heads: usize,
    pub(super) block_size: usize,
    pub(super) rows: usize,
    pub(super) max_blocks: usize,
    max_context_len: usize,
    nq: usize,
    pub(super) scale_log2: f32,
    /// 0 bidirectional, 1 causal, B block-causal (see the kernel's header).
    mask_block: u32,
}

/// What a decode kernel with `qkv_rope_write` folded in (the ring, or the one-query SIMT kernel)
/// takes besides [`Inputs`] (whose `q` is then the fused QKV output).
struct Rope<'a> {
    cos: &'a Tensor,
    sin: &'a Tensor,
    slots: &'a Tensor,
    num_slots: i64,
}

/// Where a decode attention launch writes: its output `[T, H, D]` and the split partials'
/// workspace (f32 `acc` and `ml`, u32 `own`, flat and at least as long as the launch needs, else
/// that part is allocated) — a decode arena's buffers.
pub struct AttentionInto<'a> {
    pub out: &'a Tensor,
    pub acc: &'a Tensor,
    pub ml: &'a Tensor,
    pub own: &'a Tensor,
}

/// Storage guards of an [`AttentionInto`], held while its views are in use.
type IntoGuards<'a> = [(candle_core::StorageRef<'a>, &'a candle_core::Layout); 4];

/// The first `len` elements of a given workspace part, or a fresh buffer where it is shorter
/// (or none is given).
///
/// # Safety
/// As [`Dest::new`]: the kernels must write every element they later read.
pub(super) unsafe fn scratch<'a, T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    len: usize,
    given: Option<&'a (candle_core::StorageRef<'a>, &'a candle_core::Layout)>,
    name: &str,
) -> Result<Dest<'a, T>> {
    if let Some((s, l)) = given {
        if l.shape().elem_count() >= len {
            let whole = view::<T>(s, l, OP, name, true)?;
            return Ok(Dest::Given(whole.slice(0..len)));
        }
    }
    Ok(Dest::Fresh(unsafe { dev.alloc::<T>(len)? }))
}

/// `rope`: `qkv_rope_write` folded in — into the ring with `p.ring`, else into the one-query SIMT
/// kernel (the caller checked one query item a row and kv head, and not the tensor-core path).
/// `into`: the output and workspace are given.
fn launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    name: &str,
    t: &Inputs,
    p: &Params,
    rope: Option<&Rope>,
    into: Option<&AttentionInto>,
) -> Result<Tensor> {
    let guards: Option<IntoGuards> =
        into.map(|g| [g.out.storage_and_layout(), g.acc.storage_and_layout(), g.ml.storage_and_layout(), g.own.storage_and_layout()]);
    let given = |i: usize| guards.as_ref().map(|g| &g[i]);
    let out_given = given(0).map(|(s, l)| (&**s, *l));
    let given_out = into.map(|g| g.out);
    let (qs, ql) = t.q.storage_and_layout();
    let (ks, kl) = t.k.storage_and_layout();
    let (vs, vl) = t.v.storage_and_layout();
    let (bts, btl) = t.bt.storage_and_layout();
    let (cls, cll) = t.cl.storage_and_layout();
    let (cus, cul) = t.cu.storage_and_layout();
    let q = view::<T>(&qs, ql, OP, "q", true)?;
    let k = view::<T>(&ks, kl, OP, "k_cache", true)?;
    let v = view::<T>(&vs, vl, OP, "v_cache", true)?;
    let bt = view::<u32>(&bts, btl, OP, "block_tables", false)?;
    let cl = view::<u32>(&cls, cll, OP, "context_lens", false)?;
    let cu = view::<u32>(&cus, cul, OP, "cu_q_lens", false)?;

    let group = p.heads / p.kv_heads;
    let n_out = p.tokens * p.heads * p.hd;
    let bs_shift: i32 = if p.block_size.is_power_of_two() { p.block_size.trailing_zeros() as i32 } else { -1 };
    let (num_rows, max_blocks, heads, kv_heads, block_size) = (p.rows as i32, p.max_blocks as i32, p.heads as i32, p.kv_heads as i32, p.block_size as i32);
    let (mask_block, tokens) = (p.mask_block as i32, p.tokens as i32);
    let scale_log2 = p.scale_log2;
    if p.mma {
        let tiles = (p.tokens * group + p.rows * (MMA_NQ - 1)) / MMA_NQ;
        // SAFETY: every element is written by the kernel (cu_q_lens[R] == T covers every token).
        let mut out = unsafe { Dest::<T>::new(dev, n_out, out_given, OP, "out")? };
        let kernel = if p.pipe { "paged_attn_mma_pipe" } else { "paged_attn_mma" };
        let func = kernel!(dev, Module::PagedAttention, &format!("{kernel}_{name}_d{}", p.hd))?;
        let cfg = LaunchConfig { grid_dim: (tiles as u32, p.kv_heads as u32, 1), block_dim: ((NW * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = func.builder();
        out.push(&mut b);
        b.arg(&q).arg(&k).arg(&v).arg(&bt).arg(&cl).arg(&cu);
        b.arg(&num_rows).arg(&max_blocks).arg(&heads).arg(&kv_heads).arg(&block_size).arg(&bs_shift);
        b.arg(&scale_log2).arg(&mask_block);
        // SAFETY: argument list matches `paged_attn_mma_*` / `paged_attn_mma_pipe_*` in paged_attention.cu.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        return Ok(out.finish(dev, (p.tokens, p.heads, p.hd), given_out));
    }
    // With `rope` the caches are written in place (each row's newest key and value) through
    // these views taken under the storage read lock, as qkv_rope_write writes them; the stream
    // orders every use.
    let storages = rope.map(|r| (r.cos.storage_and_layout(), r.sin.storage_and_layout(), r.slots.storage_and_layout()));
    let views = match (rope, &storages) {
        (Some(r), Some(((cs, cl_), (ss, sl), (ms, ml)))) => Some(RopeViews {
            cos: view::<T>(cs, cl_, OP, "cos", true)?,
            sin: view::<T>(ss, sl, OP, "sin", true)?,
            slots: view::<u32>(ms, ml, OP, "slot_mapping", false)?,
            num_slots: r.num_slots,
        }),
        _ => None,
    };
    if p.ring {
        let grid = super::attention_ring::ring_grid(dev)?;
        let slots = grid + p.rows;
        // SAFETY (the four): one query a row, so every (token, head) of the output is written by
        // the ring kernel (a row one block walked whole) or by the combine (split rows and rows
        // without keys); the combine uses a partial's acc only where its sum is positive, and
        // reads (max, sum) and entries only where the ring kernel wrote them this launch.
        let mut dests = unsafe {
            (
                Dest::<T>::new(dev, n_out, out_given, OP, "out")?,
                scratch::<f32>(dev, slots * p.heads * p.hd, given(1), "acc")?,
                scratch::<f32>(dev, slots * p.heads * 2, given(2), "ml")?,
                scratch::<u32>(dev, grid * 4, given(3), "own")?,
            )
        };
        launch_ring::<T>(dev, name, p, [&q, &k, &v], [&bt, &cl, &cu], views.as_ref(), (&mut dests.0, &mut dests.1, &mut dests.2, &mut dests.3))?;
        return Ok(dests.0.finish(dev, (p.tokens, p.heads, p.hd), given_out));
    }
    let nq = p.nq;
    // Tiles of nq query items per kv head: see the row search in the kernel.
    let tiles = (p.tokens * group + p.rows * (nq - 1)) / nq;
    if tiles > i32::MAX as usize {
        bail!("paged attention (cuda): too many query tiles");
    }
    let base_blocks = tiles * p.kv_heads;
    let step = NW * keys_per_warp_step(p.hd, std::mem::size_of::<T>(), nq);
    let kernel_name = |build: SimtBuild, folded: bool| {
        let rope = if folded { "rope_" } else { "" };
        format!("paged_attn_{rope}{name}_d{}_q{nq}{}", p.hd, build.suffix())
    };
    // Blocks of a build that run at once (asked only where the plan would split; cached). A
    // folded launch plans with the unfolded build's figure, so that it cuts the keys exactly as
    // the two-launch path does (its output is then that path's, bit for bit).
    let wave = |build: SimtBuild| wave_blocks(dev, &kernel_name(build, false), build.warps() * 32);
    let sms = sm_count(dev)?;
    let plan = attention_split::plan(p.max_context_len, base_blocks, sms, step, nq == 1, crate::ops::policy::current().simt_deep, wave)?;
    let kname = kernel_name(plan.build, views.is_some());
    let splits = plan.splits;
    // The kernel takes chunk 0 as "cut the actual longest context" (for `wave` blocks at once).
    let (chunk, wave) = match plan.cut {
        Cut::Whole => (i32::MAX as usize, 1),
        Cut::Chunks(chunk) => (chunk, 1),
        Cut::InKernel { wave_blocks } => (0, wave_blocks),
    };

    // SAFETY: every element is written by the kernels (cu_q_lens[R] == T covers every token).
    let mut out = unsafe { Dest::<T>::new(dev, n_out, out_given, OP, "out")? };
    let func = kernel!(dev, Module::PagedAttention, &kname)?;
    let threads = (plan.build.warps() * 32) as u32;
    let cfg = LaunchConfig { grid_dim: (tiles as u32, p.kv_heads as u32, splits as u32), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let (nsplits, chunk, wave) = (splits as i32, chunk.min(i32::MAX as usize) as i32, wave.min(i32::MAX as usize) as i32);
    let null = 0u64;
    let mut ws = split_workspace(dev, splits, p, [given(1), given(2)])?;
    {
        let mut b = func.builder();
        out.push(&mut b);
        workspace_args(&mut b, &mut ws, &null);
        b.arg(&q).arg(&k).arg(&v).arg(&bt).arg(&cl).arg(&cu);
        b.arg(&num_rows).arg(&max_blocks).arg(&heads).arg(&kv_heads).arg(&block_size).arg(&bs_shift);
        b.arg(&scale_log2).arg(&mask_block).arg(&nsplits).arg(&chunk).arg(&wave).arg(&tokens);
        let q_stride = ((p.heads + 2 * p.kv_heads) * p.hd) as i32;
        if let Some(r) = &views {
            b.arg(&r.cos).arg(&r.sin).arg(&r.slots).arg(&k).arg(&v).arg(&r.num_slots).arg(&q_stride);
        }
        // SAFETY: argument list matches `paged_attn_*` (with `rope`, `paged_attn_rope_*`) in
        // paged_attention.cu; sizes checked above (with `rope` by `qkv_rope_paged_attention`: one
        // query a row and kv head, the qkv, cos / sin and slot shapes, 16-byte aligned starts).
        unsafe { b.launch(cfg) }.w()?;
    }
    crate::ops::policy::count(|c| {
        c.simt_rope += u64::from(views.is_some());
        c.simt_eight_warp += u64::from(plan.build.warps() == 8);
        c.simt_deep += u64::from(plan.build == SimtBuild::EightWarpsDeep);
    });
    if let Some(ws) = &mut ws {
        combine::<T>(dev, name, p, &mut out, ws, splits)?;
    }
    Ok(out.finish(dev, (p.tokens, p.heads, p.hd), given_out))
}

/// A split launch's partials: `acc` and (max, sum) in f32.
type Workspace<'a> = (Dest<'a, f32>, Dest<'a, f32>);

/// Partial sums of a split launch: `acc` `[splits, T, H, D]` and (max, sum) `[splits, T, H, 2]`
/// (f32); none for one split.
/// (given: the arena's `acc` and `ml`, used where long enough).
fn split_workspace<'a>(
    dev: &CudaDevice,
    splits: usize,
    p: &Params,
    given: [Option<&'a (candle_core::StorageRef<'a>, &'a candle_core::Layout)>; 2],
) -> Result<Option<Workspace<'a>>> {
    if splits <= 1 {
        return Ok(None);
    }
    // SAFETY: the attention kernel writes every (split, token, head) entry it covers, and the
    // combine kernel reads only those.
    let acc = unsafe { scratch::<f32>(dev, splits * p.tokens * p.heads * p.hd, given[0], "acc")? };
    let ml = unsafe { scratch::<f32>(dev, splits * p.tokens * p.heads * 2, given[1], "ml")? };
    Ok(Some((acc, ml)))
}

/// Pushes a split launch's workspace (`acc`, `ml`) onto a kernel's arguments, or two null
/// pointers for one split.
fn workspace_args<'s: 'a, 'a>(b: &mut LaunchArgs<'a>, ws: &'s mut Option<Workspace>, null: &'a u64) {
    match ws {
        Some((acc, ml)) => {
            acc.push(b);
            ml.push(b);
        }
        None => {
            b.arg(null);
            b.arg(null);
        }
    }
}

/// Merges a split launch's partials into `out` (`paged_attn_combine_*`).
fn combine<T: CudaDType + DeviceRepr>(dev: &CudaDevice, name: &str, p: &Params, out: &mut Dest<T>, ws: &mut Workspace, splits: usize) -> Result<()> {
    let func = kernel!(dev, Module::PagedAttention, &format!("paged_attn_combine_{name}_d{}", p.hd))?;
    let cfg = LaunchConfig { grid_dim: (p.tokens as u32, p.heads as u32, 1), block_dim: (p.hd as u32, 1, 1), shared_mem_bytes: 0 };
    let (nsplits, tokens, heads) = (splits as i32, p.tokens as i32, p.heads as i32);
    let mut b = func.builder();
    out.push(&mut b);
    ws.0.push(&mut b);
    ws.1.push(&mut b);
    b.arg(&nsplits).arg(&tokens).arg(&heads);
    // SAFETY: matches `paged_attn_combine_*`; the workspace holds splits x T x H entries.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Whether the one-query SIMT kernel with `qkv_rope_write` folded in takes a decode launch (one
/// query a row, checked by the caller) the ring declined: one query item a row and kv head (MHA:
/// the kernel's one-item builds), bf16 / f16, a head dim it is built for — unless the engine's
/// `KernelPolicy::fold_simt` is off. At 16 rows it shortened an Ouro-1.4B CB step by 1.5 % on
/// the H200 (prompt 2048: 1.2 %), where the ring's fold is only level.
fn simt_fold_takes(dtype: DType, heads: usize, kv_heads: usize, hd: usize) -> bool {
    crate::ops::policy::current().fold_simt && heads == kv_heads && matches!(dtype, DType::BF16 | DType::F16) && matches!(hd, 64 | 96 | 128)
}

/// What a decode kernel with `qkv_rope_write` folded in reads besides its own arguments (the
/// fused QKV output is its `q`).
pub(super) struct RopeViews<'a, T> {
    pub(super) cos: CudaView<'a, T>,
    pub(super) sin: CudaView<'a, T>,
    pub(super) slots: CudaView<'a, u32>,
    pub(super) num_slots: i64,
}

/// Decode attention with `qkv_rope_write` folded in: the kernel rotates q out of `qkv`
/// `[T, (heads + 2 kv_heads) * head_dim]` with `cos` / `sin` `[T, head_dim / 2]` itself, reads
/// every row's keys but the newest from the caches, attends to the newest key and value straight
/// from `qkv` and writes them to the caches at `slot_mapping` for later steps — the same cache
/// writes as `qkv_rope_write`. Where the decode ring takes the launch, the ring kernel
/// (`paged_decode_ring_rope_*`): its output is `qkv_rope_write` then [`paged_attention`]'s up to the
/// softmax's rounding (where a row's newest key scores highest its running maximum is raised in
/// two steps instead of one). Else, for one query item a row and kv head (MHA decode, bf16 / f16,
/// head dim 64 / 96 / 128), the one-query SIMT kernel (`paged_attn_rope_*`), which cuts the keys
/// as the two-launch path does and gives its output bit for bit for every row with a slot of its
/// own (a graph's padding rows share one; their outputs are discarded); `KernelPolicy::fold_simt` off turns that
/// form off (a measurement switch for A/B runs on the device). The caller must have each row's
/// token at its context's last position (`slot_mapping[t]` is position `ctx - 1` of the row's
/// table: a looped launch). `Ok(None)` where neither takes the launch (not one query a row,
/// another head dim or dtype, GQA groups the ring does not take, unaligned or non-contiguous
/// inputs): the caller then runs the two ops.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_paged_attention(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
    block_tables: &Tensor,
    context_lens: &Tensor,
    cu_q_lens: &Tensor,
    max_q_len: usize,
    max_context_len: usize,
    scale: f32,
    heads: usize,
    kv_heads: usize,
    into: Option<&AttentionInto>,
) -> Result<Option<Tensor>> {
    let dev = device(qkv, OP)?;
    let dtype = qkv.dtype();
    let all = [cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens, cu_q_lens];
    if !all.iter().all(|t| t.device().same_device(qkv.device())) {
        return Ok(None);
    }
    if [cos, sin, k_cache, v_cache].iter().any(|t| t.dtype() != dtype)
        || [slot_mapping, block_tables, context_lens, cu_q_lens].iter().any(|t| t.dtype() != DType::U32)
    {
        return Ok(None);
    }
    let (Ok((tokens, width)), Ok((_num_blocks, block_size, kvh, hd)), Ok((rows, max_blocks))) = (qkv.dims2(), k_cache.dims4(), block_tables.dims2()) else {
        return Ok(None);
    };
    let aligned = |t: &Tensor| t.is_contiguous() && (t.layout().start_offset() * dtype.size_in_bytes()) % 16 == 0;
    let i32_ok = |x: usize| x <= i32::MAX as usize;
    let fits = kvh == kv_heads
        && v_cache.dims() == k_cache.dims()
        && kv_heads > 0
        && heads % kv_heads == 0
        && width == (heads + 2 * kv_heads) * hd
        && cos.dims() == [tokens, hd / 2]
        && sin.dims() == [tokens, hd / 2]
        && block_size > 0
        && rows > 0
        && context_lens.dims() == [rows]
        && cu_q_lens.dims() == [rows + 1]
        && slot_mapping.dims() == [tokens]
        && [cos, sin, k_cache, v_cache].iter().all(|t| aligned(t))
        && i32_ok(tokens * heads)
        && i32_ok(width)
        && i32_ok(max_blocks)
        && i32_ok(max_context_len)
        && max_q_len == 1
        && tokens == rows
        && into.is_none_or(|g| g.out.dims() == [tokens, heads, hd] && g.out.dtype() == dtype && g.out.device().same_device(qkv.device()));
    if !fits {
        return Ok(None);
    }
    let shape = [tokens, rows, max_q_len, heads, kv_heads, hd, block_size, max_context_len];
    let ring = ring_takes(&dev, &crate::ops::policy::current(), dtype, shape, true)?;
    if !ring && !simt_fold_takes(dtype, heads, kv_heads, hd) {
        return Ok(None);
    }
    let mut qkv = qkv.contiguous()?;
    if !aligned(&qkv) {
        qkv = qkv.copy()?;
    }
    let p = Params {
        mma: false,
        pipe: false,
        ring,
        tokens,
        heads,
        hd,
        kv_heads,
        block_size,
        rows,
        max_blocks,
        max_context_len,
        nq: 1,
        scale_log2: scale * std::f32::consts::LOG2_E,
        mask_block: 1,
    };
    let t = Inputs { q: &qkv, k: k_cache, v: v_cache, bt: block_tables, cl: context_lens, cu: cu_q_lens };
    let num_slots = (k_cache.dims()[0] * block_size) as i64;
    let rope = Rope { cos, sin, slots: slot_mapping, num_slots };
    for_float!(dtype, OP, |T, suf| launch::<T>(&dev, suf, &t, &p, Some(&rope), into)).map(Some)
}

/// Blocks of kernel `name` that run at once on `dev` (SMs × blocks an SM by the occupancy
/// calculator), cached per device and kernel.
fn wave_blocks(dev: &CudaDevice, name: &str, threads: usize) -> Result<usize> {
    super::launch::resident_blocks(dev, name, (threads, 0), || {
        let func = kernel!(dev, Module::PagedAttention, name)?;
        Ok(func.occupancy_max_active_blocks_per_multiprocessor(threads as u32, 0, None).w()? as usize)
    })
}
