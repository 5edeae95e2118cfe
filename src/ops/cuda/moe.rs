//! Mixture-of-experts kernels (`kernels/moe.cu`): routing, grouping the (token, expert) pairs by
//! expert, the grouped SwiGLU and down GEMMs on tensor cores, and the weighted combine. Entry
//! points in `crate::ops::moe`.

use super::launch::{compute_capability, compute_major, device, kernel, same_device_dtype, sm_count, view, wrap, Module};
use crate::ops::moe::{MoeKernels, RouterArch, Scoring, StackedExperts};
use candle_core::cuda_backend::cudarc::driver::sys::{self, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// Router logits `[tokens, experts]` (f32) to the chosen experts `[tokens, top_k]` u32 and their
/// weights `[tokens, top_k]` f32, one warp per token.
pub fn moe_route(logits: &Tensor, bias: Option<&Tensor>, arch: &RouterArch) -> Result<(Tensor, Tensor)> {
    const OP: &str = "moe_route";
    let dev = device(logits, OP)?;
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let (tokens, e) = logits.dims2()?;
    if let Some(reason) = arch.shape_error() {
        bail!("{OP} (cuda): {reason}");
    }
    if e != arch.num_experts {
        bail!("{OP} (cuda): {e} logits per token for {} experts", arch.num_experts);
    }
    let bias = bias.map(|b| b.to_dtype(DType::F32)?.contiguous()).transpose()?;
    let bias = bias.as_ref();
    if let Some(b) = bias {
        same_device_dtype(OP, DType::F32, &logits, &[("bias", b)])?;
        if b.dims() != [e] {
            bail!("{OP} (cuda): bias {:?} for {e} experts", b.dims());
        }
    }
    let k = arch.top_k;
    if tokens == 0 {
        return Ok((Tensor::zeros((0, k), DType::U32, logits.device())?, Tensor::zeros((0, k), DType::F32, logits.device())?));
    }
    // Per warp: scores and choice scores of every expert, and the group scores.
    let per_warp = (2 * e + arch.n_group) * 4;
    let warps = (48 * 1024 / per_warp).clamp(1, 4);
    if per_warp > 48 * 1024 || tokens > i32::MAX as usize {
        bail!("{OP} (cuda): {e} experts or {tokens} tokens out of range");
    }
    let (ls, ll) = logits.storage_and_layout();
    let logits_v = view::<f32>(&ls, ll, OP, "logits", false)?;
    // SAFETY: the kernel writes all top_k ids and weights of every token.
    let mut ids = unsafe { dev.alloc::<u32>(tokens * k)? };
    let mut weights = unsafe { dev.alloc::<f32>(tokens * k)? };
    let (func, cfg) = match route_lane_width(e, k, arch.n_group) {
        Some(per) => {
            let func = kernel!(dev, Module::Moe, &format!("moe_route_reg_p{per}"))?;
            (func, LaunchConfig { grid_dim: (tokens.div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 })
        }
        None => {
            let func = kernel!(dev, Module::Moe, "moe_route")?;
            let blocks = tokens.div_ceil(warps) as u32;
            (func, LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * warps as u32, 1, 1), shared_mem_bytes: (warps * per_warp) as u32 })
        }
    };
    let ints = [tokens, e, k, arch.n_group, arch.topk_group].map(|v| v as i32);
    let (softmax, norm, scale) = (i32::from(arch.scoring == Scoring::Softmax), i32::from(arch.norm_topk), arch.scale as f32);
    let bias_guard = bias.map(|b| b.storage_and_layout());
    let bias_v = match &bias_guard {
        Some((bs, bl)) => Some(view::<f32>(bs, bl, OP, "bias", false)?),
        None => None,
    };
    let null = 0u64;
    let mut b = func.builder();
    b.arg(&mut ids).arg(&mut weights).arg(&logits_v);
    match &bias_v {
        Some(v) => b.arg(v),
        None => b.arg(&null),
    };
    for v in &ints {
        b.arg(v);
    }
    b.arg(&softmax).arg(&norm).arg(&scale);
    // SAFETY: argument list matches `moe_route` in moe.cu; shapes checked above.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok((wrap(ids, &dev, (tokens, k)), wrap(weights, &dev, (tokens, k))))
}

/// Experts per lane of `moe_route_reg_p*` for `e` experts in `groups` groups choosing `k`: the
/// fewest that hold every expert in registers (at most 8) with each group on whole lanes, a
/// power of two of them. None: the shared-memory `moe_route` serves the shape.
fn route_lane_width(e: usize, k: usize, groups: usize) -> Option<usize> {
    if k > 32 || e > 32 * 8 {
        return None;
    }
    (e.div_ceil(32).max(1)..=8).find(|&per| groups <= 1 || (e % groups == 0 && (e / groups) % per == 0 && (e / groups / per).is_power_of_two()))
}

/// The routed experts' weighted sum (+ `shared`) of `x` `[tokens, hidden]`, for experts in the
/// kernels' layout: group the pairs by expert, SwiGLU GEMM, down GEMM, combine (+ `residual`,
/// added after the cast).
pub fn moe_experts(x: &Tensor, ids: &Tensor, weights: &Tensor, experts: &StackedExperts, shared: Option<&Tensor>, residual: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "moe_experts";
    let dev = device(x, OP)?;
    let dtype = x.dtype();
    let x = x.contiguous()?;
    let (gate_up, down) = experts.kernel_weights();
    let fp8 = experts.fp8_scales();
    let weight_dtype = if fp8.is_some() { DType::F8E4M3 } else { dtype };
    same_device_dtype(OP, weight_dtype, &x, &[("gate_up", gate_up), ("down", down)])?;
    if let Some((gs, ds)) = fp8 {
        same_device_dtype(OP, DType::F32, &x, &[("gate_up scales", gs), ("down scales", ds)])?;
        let (e, two_w, _) = gate_up.dims3()?;
        if gs.dims() != [e, two_w] || ds.dims() != [e, down.dim(1)?] || gate_up.dim(2)? % 16 != 0 || down.dim(2)? % 16 != 0 {
            bail!("{OP} (cuda): FP8 experts gate_up {:?} (scales {:?}), down {:?} (scales {:?})", gate_up.dims(), gs.dims(), down.dims(), ds.dims());
        }
    }
    same_device_dtype(OP, DType::U32, &x, &[("ids", ids)])?;
    same_device_dtype(OP, DType::F32, &x, &[("weights", weights)])?;
    let (tokens, h) = x.dims2()?;
    let (e, two_w, gh) = gate_up.dims3()?;
    let (_, k) = ids.dims2()?;
    if gh != h || ids.dims() != [tokens, k] || weights.dims() != ids.dims() || two_w == 0 || two_w % 32 != 0 || h == 0 || h % 8 != 0 || h > 8192 {
        bail!("{OP} (cuda): x {:?}, ids {:?}, weights {:?}, gate_up {:?}", x.dims(), ids.dims(), weights.dims(), gate_up.dims());
    }
    // The grouping kernels keep two counters per expert in shared memory (48 KB by default, of
    // which `moe_offsets` takes 256 bytes for its scan).
    if e > 6112 {
        bail!("{OP} (cuda): {e} experts (at most 6112)");
    }
    let shared = shared.map(|s| s.contiguous()).transpose()?;
    if let Some(s) = &shared {
        same_device_dtype(OP, dtype, &x, &[("shared", s)])?;
        if s.dims() != [tokens, h] {
            bail!("{OP} (cuda): shared {:?} for x {:?}", s.dims(), x.dims());
        }
    }
    let residual = residual.map(|r| r.contiguous()).transpose()?;
    if let Some(r) = &residual {
        same_device_dtype(OP, dtype, &x, &[("residual", r)])?;
        if r.dims() != [tokens, h] {
            bail!("{OP} (cuda): residual {:?} for x {:?}", r.dims(), x.dims());
        }
    }
    if tokens == 0 || k == 0 {
        let out = match &shared {
            Some(s) if k == 0 => s.clone(),
            _ => Tensor::zeros((tokens, h), dtype, x.device())?,
        };
        return match &residual {
            Some(r) => r + out,
            None => Ok(out),
        };
    }
    let pairs = tokens * k;
    if pairs.saturating_mul(h.max(two_w)) > i32::MAX as usize * 8 || pairs > u32::MAX as usize / 2 {
        bail!("{OP} (cuda): {pairs} routed pairs out of range");
    }
    let ids = ids.contiguous()?;
    let weights = weights.contiguous()?;
    let a = ExpertArgs {
        x: &x,
        ids: &ids,
        weights: &weights,
        gate_up,
        down,
        fp8,
        shared: shared.as_ref(),
        residual: residual.as_ref(),
        tokens,
        h,
        e,
        w: two_w / 2,
        k,
    };
    match dtype {
        DType::BF16 => experts_launch::<half::bf16>(&dev, "bf16", &a),
        DType::F16 => experts_launch::<half::f16>(&dev, "f16", &a),
        d => bail!("{OP} (cuda): dtype {d:?} (bf16 or f16)"),
    }
}

struct ExpertArgs<'a> {
    x: &'a Tensor,
    ids: &'a Tensor,
    weights: &'a Tensor,
    gate_up: &'a Tensor,
    down: &'a Tensor,
    /// FP8 experts (`gate_up` and `down` in E4M3): their rows' scales.
    fp8: Option<(&'a Tensor, &'a Tensor)>,
    shared: Option<&'a Tensor>,
    residual: Option<&'a Tensor>,
    tokens: usize,
    h: usize,
    e: usize,
    w: usize,
    k: usize,
}

/// Columns of one GEMM block tile, its depth, shared-memory bytes per tile row and pipeline
/// stages (kernel constants `BN`, `BK`, `ROW_BYTES`, `STAGES`).
const BN: usize = 128;
const BK: usize = 64;
const ROW_BYTES: usize = 2 * BK;
const STAGES: usize = 3;

/// Tile, stages and threads of the warp-specialised Hopper GEMM (kernel constants `WS_BM`,
/// `WS_BN`, `WS_BN_FP8`, `WS_STAGES`, `WS_THREADS`).
const WS_BM: usize = 128;
const WS_BN: usize = 256;
const WS_BN_FP8: usize = 128;
const WS_STAGES: usize = 4;
const WS_THREADS: u32 = 384;

/// One consumer warpgroup's epilogue buffer: 64 rows × 256 bytes (kernel constant `WS_EPI_BYTES`).
const WS_EPI_BYTES: usize = 64 * 256;

/// The warp-specialised GEMM's tile width for weights of `dtype` (the kernel's `ws_bn`): E4M3
/// tiles are narrower, since their promoted sums need a second accumulator fragment.
fn ws_bn(dtype: DType) -> usize {
    if dtype == DType::F8E4M3 {
        WS_BN_FP8
    } else {
        WS_BN
    }
}

/// Dynamic shared memory of the warp-specialised GEMM of `bn`-column tiles: its stages, for the plain epilogue two
/// consumer buffers (`ws_epi_buffers`), the stages' full/empty barriers, and 1 KB so that the
/// kernel can align the stages to the 1024 bytes the swizzle repeats over.
const fn ws_smem(plain_epilogue: bool, bn: usize) -> u32 {
    let buffers = if plain_epilogue { 2 * WS_EPI_BYTES } else { 0 };
    (WS_STAGES * (WS_BM + bn) * ROW_BYTES + buffers + WS_STAGES * 16 + 1024) as u32
}

/// A TMA descriptor (`CUtensorMap`), passed to a kernel by value (`__grid_constant__`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaMap(sys::CUtensorMap);

// SAFETY: a plain 128-byte struct of integers, laid out as the kernel's `TmaMap`.
unsafe impl DeviceRepr for TmaMap {}

/// The TMA map of stacked expert weights `[experts, n, k]` read as one 2-D tensor `[experts · n,
/// k]` in boxes of 128 bytes of columns (64 in bf16 / f16, 128 in E4M3) × [`ws_bn`] rows with
/// 128-byte swizzle (the warp-specialised GEMM's W tiles). `ptr` is the weights' device address (16-byte
/// aligned; k's bytes a multiple of 16).
fn weight_map(op: &str, dtype: DType, ptr: u64, experts: usize, n: usize, k: usize) -> Result<TmaMap> {
    use sys::{CUtensorMapDataType as D, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle};
    let (elem, rows) = (dtype.size_in_bytes(), ws_bn(dtype));
    let dtype = match dtype {
        DType::BF16 => D::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => D::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::F8E4M3 => D::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        d => bail!("{op} (cuda): no TMA map for {d:?} weights"),
    };
    // The kernel addresses W's rows with i32 coordinates.
    if experts * n > i32::MAX as usize {
        bail!("{op} (cuda): {experts} experts of {n} rows exceed the TMA map's i32 rows");
    }
    let dims = [k as u64, (experts * n) as u64];
    let strides = [(k * elem) as u64];
    let boxes = [(ROW_BYTES / elem) as u32, rows as u32];
    let steps = [1u32, 1];
    let mut map = TmaMap(sys::CUtensorMap { opaque: [0; 16] });
    // SAFETY: every array outlives the call and has the rank-2 lengths the driver reads (strides:
    // rank − 1); the driver only encodes the descriptor, it does not touch the device memory.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map.0,
            dtype,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .w()?;
    Ok(map)
}

/// Launch configuration of the warp-specialised GEMM `func` of `bn`-column tiles over `work`
/// items: persistent, one CTA per SM (192 KB of stages each at 256 columns), fewer when there are
/// fewer items.
fn ws_config(func: &CudaFunction, work: usize, sms: usize, plain_epilogue: bool, bn: usize) -> Result<LaunchConfig> {
    let smem = ws_smem(plain_epilogue, bn);
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    Ok(LaunchConfig { grid_dim: (work.min(sms) as u32, 1, 1), block_dim: (WS_THREADS, 1, 1), shared_mem_bytes: smem })
}

/// Launch shape of a grouped GEMM with `bm`-row tiles: threads, and dynamic shared memory (over
/// the 48 KB a launch gets by default, so `func` is opted in).
fn gemm_shape(func: &CudaFunction, bm: usize) -> Result<(u32, u32)> {
    let smem = STAGES * (bm + BN) * ROW_BYTES;
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    // Four warps at either height: 64 x 32 warp tiles at 64 rows, 64 x 64 at 128.
    Ok((128, smem as u32))
}

/// Whether the grouped FP8 GEMMs run on `device`: their E4M3 MMAs need compute capability 8.9
/// (Ada) or later; the module's kernels trap on older GPUs.
pub fn fp8_experts_serve(device: &candle_core::Device) -> bool {
    match device {
        candle_core::Device::Cuda(d) => compute_capability(d).is_ok_and(|cc| cc >= (8, 9)),
        _ => false,
    }
}

/// The grid of a grouped `mma.sync` GEMM: its column tiles over `n`, `max_tiles` row tiles, and
/// its shape from [`gemm_shape`].
fn grouped_config(n: usize, max_tiles: usize, (threads, smem): (u32, u32)) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(BN) as u32, max_tiles as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem }
}

/// Whether the Hopper warpgroup-MMA kernels run: built for sm_90a (other targets compile them to
/// a trap), on an sm_90 device, and not turned off by the engine's `KernelPolicy::moe`.
fn wgmma_available(dev: &CudaDevice) -> Result<bool> {
    Ok(cfg!(ponder_wgmma) && crate::ops::policy::current().moe == MoeKernels::Auto && compute_major(dev)? == 9)
}

fn experts_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, a: &ExpertArgs) -> Result<Tensor> {
    const OP: &str = "moe_experts";
    let (tokens, h, e, w, k) = (a.tokens, a.h, a.e, a.w, a.k);
    let pairs = tokens * k;
    // Taller tiles once experts average enough rows to fill them.
    let bm = if pairs / e >= 96 { 128 } else { 64 };
    let max_tiles = pairs.div_ceil(bm) + e;
    // 128-row tiles run on Hopper's warpgroup MMA where it is available.
    let hopper = bm == 128 && wgmma_available(dev)?;
    // Row tiles are the mma.sync grid's second dimension (at most 65535 blocks); the Hopper
    // kernel's persistent grid has no such limit.
    if !hopper && max_tiles > 65_535 {
        bail!("{OP} (cuda): {pairs} routed pairs need {max_tiles} row tiles (at most 65535)");
    }
    let (xs, xl) = a.x.storage_and_layout();
    let (is, il) = a.ids.storage_and_layout();
    let (ws, wl) = a.weights.storage_and_layout();
    let (gs, gl) = a.gate_up.storage_and_layout();
    let (ds, dl) = a.down.storage_and_layout();
    let x_v = view::<T>(&xs, xl, OP, "x", true)?;
    let ids_v = view::<u32>(&is, il, OP, "ids", false)?;
    let w_v = view::<f32>(&ws, wl, OP, "weights", false)?;
    // SAFETY: the grouping kernels write every sorted slot of a routed pair, every pair's position, every
    // expert's end and every tile slot; the GEMMs write every row a tile covers; the combine
    // writes every output element. Nothing reads what was not written.
    let mut sorted_src = unsafe { dev.alloc::<u32>(pairs)? };
    let mut pos_of_pair = unsafe { dev.alloc::<u32>(pairs)? };
    let mut expert_end = unsafe { dev.alloc::<u32>(e)? };
    let mut tile_expert = unsafe { dev.alloc::<u32>(max_tiles)? };
    let mut tile_start = unsafe { dev.alloc::<u32>(max_tiles)? };
    let mut act = unsafe { dev.alloc::<T>(pairs * w)? };
    let mut y = unsafe { dev.alloc::<T>(pairs * h)? };
    let mut out = unsafe { dev.alloc::<T>(tokens * h)? };

    // Grouping: count per expert, lay the experts out and cut tiles, place every pair.
    let mut counts = dev.alloc_zeros::<u32>(e)?;
    let mut cursor = unsafe { dev.alloc::<u32>(e)? };
    let (p, ki, ei, bmi, mt) = (pairs as i32, k as i32, e as i32, bm as i32, max_tiles as i32);
    let blocks = pairs.div_ceil(1024) as u32;
    let count = kernel!(dev, Module::Moe, "moe_count")?;
    let mut b = count.builder();
    b.arg(&mut counts).arg(&ids_v).arg(&p).arg(&ei);
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: (e * 4) as u32 };
    // SAFETY: argument list matches `moe_count` in moe.cu; counts were zeroed.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    let offsets = kernel!(dev, Module::Moe, "moe_offsets")?;
    let mut b = offsets.builder();
    b.arg(&mut cursor).arg(&mut expert_end).arg(&mut tile_expert).arg(&mut tile_start).arg(&counts).arg(&ei).arg(&bmi).arg(&mt);
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: (2 * e * 4) as u32 };
    // SAFETY: argument list matches `moe_offsets` in moe.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    let scatter = kernel!(dev, Module::Moe, "moe_scatter")?;
    let mut b = scatter.builder();
    b.arg(&mut sorted_src).arg(&mut pos_of_pair).arg(&mut cursor).arg(&ids_v).arg(&p).arg(&ki).arg(&ei);
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: argument list matches `moe_scatter` in moe.cu; cursors start at each expert's rows.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);

    let null = 0u64;
    if let Some((gu_scale, d_scale)) = a.fp8 {
        fp8_gemms::<T>(dev, suf, a, (bm, hopper), max_tiles, (gu_scale, d_scale), &sorted_src, &tile_expert, &tile_start, &expert_end, act, &mut y)?;
    } else if hopper {
        let gu_v = view::<T>(&gs, gl, OP, "gate_up", true)?;
        let down_v = view::<T>(&ds, dl, OP, "down", true)?;
        let stream = dev.cuda_stream();
        let sms = sm_count(dev)?;
        let dtype = a.x.dtype();
        let row_tiles = max_tiles as i32;
        // A and the row map go in as device addresses, held by their guards over the launches
        // (all on the device's one stream).
        let (x_ptr, _x_guard) = x_v.device_ptr(&stream);
        let (src_ptr, _src_guard) = sorted_src.device_ptr(&stream);
        // `swiglu`: gate/up with SiLU·mul (`moe_wgmma_swiglu_*`), else the plain GEMM, whose
        // epilogue needs the shared buffers (`ws_smem`).
        let launch = |swiglu: bool, out: &mut CudaSlice<T>, input: u64, weights: &CudaView<T>, src: u64, n: usize, k: usize| -> Result<()> {
            let (w_ptr, _w_guard) = weights.device_ptr(&stream);
            let map = weight_map(OP, dtype, w_ptr, e, n, k)?;
            let name = if swiglu { "moe_wgmma_swiglu_" } else { "moe_wgmma_" };
            let func = kernel!(dev, Module::Moe, &format!("{name}{suf}"))?;
            let cfg = ws_config(&func, max_tiles * n.div_ceil(WS_BN), sms, !swiglu, WS_BN)?;
            let (ni, ki) = (n as i32, k as i32);
            let mut b = func.builder();
            b.arg(out).arg(&input).arg(&map).arg(&src);
            b.arg(&tile_expert).arg(&tile_start).arg(&expert_end).arg(&ni).arg(&ki).arg(&ki).arg(&row_tiles).arg(&0i32).arg(&ki);
            // SAFETY: argument list matches `moe_wgmma_*` in moe.cu (one k slice, A rows k apart);
            // `map` describes the live weights [e · n, k]; `input` is a live [rows, k] matrix whose
            // rows `src` picks (each < tokens), or whose sorted rows are read in place (`src` null).
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        };
        launch(true, &mut act, x_ptr, &gu_v, src_ptr, 2 * w, h)?;
        let (act_ptr, _act_guard) = act.device_ptr(&stream);
        launch(false, &mut y, act_ptr, &down_v, 0, h, w)?;
    } else {
        let gu_v = view::<T>(&gs, gl, OP, "gate_up", true)?;
        let down_v = view::<T>(&ds, dl, OP, "down", true)?;
        let tag = if bm == 128 { "bm128" } else { "bm64" };
        let cfg = |n: usize, shape: (u32, u32)| grouped_config(n, max_tiles, shape);
        let dense_rows = 0i32;
        // Gate/up of each pair's token, SiLU·mul: act [pairs, w] in sorted order.
        let swiglu = kernel!(dev, Module::Moe, &format!("moe_gemm_swiglu_{tag}_{suf}"))?;
        let shape = gemm_shape(&swiglu, bm)?;
        let (n1, k1) = ((2 * w) as i32, h as i32);
        let mut b = swiglu.builder();
        b.arg(&mut act).arg(&x_v).arg(&gu_v).arg(&sorted_src).arg(&tile_expert).arg(&tile_start).arg(&expert_end);
        b.arg(&n1).arg(&k1).arg(&k1).arg(&dense_rows);
        // SAFETY: argument list matches `moe_gemm_swiglu_*`; A rows come from sorted_src (< tokens).
        unsafe { b.launch(cfg(2 * w, shape)) }.w()?;
        drop(b);

        // Down: y [pairs, h] in sorted order, A rows taken in place.
        let plain = kernel!(dev, Module::Moe, &format!("moe_gemm_{tag}_{suf}"))?;
        let shape = gemm_shape(&plain, bm)?;
        let (n2, k2) = (h as i32, w as i32);
        let mut b = plain.builder();
        b.arg(&mut y).arg(&act).arg(&down_v).arg(&null).arg(&tile_expert).arg(&tile_start).arg(&expert_end);
        b.arg(&n2).arg(&k2).arg(&k2).arg(&dense_rows);
        // SAFETY: argument list matches `moe_gemm_*`; a null row map reads A's sorted rows in place.
        unsafe { b.launch(cfg(h, shape)) }.w()?;
        drop(b);
    }

    let combine = kernel!(dev, Module::Moe, &format!("moe_combine_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (tokens as u32, 1, 1), block_dim: ((h / 8).div_ceil(32) as u32 * 32, 1, 1), shared_mem_bytes: 0 };
    let (ki, hi) = (k as i32, h as i32);
    let shared_guard = a.shared.map(|s| s.storage_and_layout());
    let shared_v = match &shared_guard {
        Some((ss, sl)) => Some(view::<T>(ss, sl, OP, "shared", true)?),
        None => None,
    };
    let residual_guard = a.residual.map(|r| r.storage_and_layout());
    let residual_v = match &residual_guard {
        Some((rs, rl)) => Some(view::<T>(rs, rl, OP, "residual", true)?),
        None => None,
    };
    let mut b = combine.builder();
    b.arg(&mut out).arg(&y).arg(&w_v).arg(&pos_of_pair);
    for v in [&shared_v, &residual_v] {
        match v {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
    }
    b.arg(&ki).arg(&hi);
    // SAFETY: argument list matches `moe_combine_*`; positions index y's rows.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(wrap(out, dev, (tokens, h)))
}

/// The two grouped GEMMs of FP8 experts, W8A8 on `mma.sync` (E4M3 m16n8k32): the tokens'
/// rows quantized with a scale each, gate/up with SiLU·mul into `act` `[pairs, w]` (sorted
/// order), that quantized a row at a time, and down into `y` `[pairs, h]`; each GEMM scales its
/// f32 sums by the row's and the column's scales. The reference is the per-expert composition
/// under a W8A8 policy (`ops::w8a8_reference`).
#[allow(clippy::too_many_arguments)]
fn fp8_gemms<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    a: &ExpertArgs,
    (bm, hopper): (usize, bool),
    max_tiles: usize,
    (gu_scale, d_scale): (&Tensor, &Tensor),
    sorted_src: &CudaSlice<u32>,
    tile_expert: &CudaSlice<u32>,
    tile_start: &CudaSlice<u32>,
    expert_end: &CudaSlice<u32>,
    mut act: CudaSlice<T>,
    y: &mut CudaSlice<T>,
) -> Result<()> {
    const OP: &str = "moe_experts (fp8)";
    let (h, w) = (a.h, a.w);
    // `hopper`: 128-row tiles on Hopper's FP8 warpgroup MMA; elsewhere `mma.sync` E4M3 (native
    // on Ada, converted to f16 by the compiler on Hopper).
    let tag = if bm == 128 { "bm128" } else { "bm64" };
    let cfg = |n: usize, shape: (u32, u32)| grouped_config(n, max_tiles, shape);
    let dense_rows = 0i32;
    let null = 0u64;
    let (gs, gl) = a.gate_up.storage_and_layout();
    let (ds, dl) = a.down.storage_and_layout();
    let gu_v = view::<float8::F8E4M3>(&gs, gl, OP, "gate_up", true)?;
    let down_v = view::<float8::F8E4M3>(&ds, dl, OP, "down", true)?;
    let (gss, gsl) = gu_scale.storage_and_layout();
    let (dss, dsl) = d_scale.storage_and_layout();
    let gu_s = view::<f32>(&gss, gsl, OP, "gate_up scales", false)?;
    let d_s = view::<f32>(&dss, dsl, OP, "down scales", false)?;

    // Gate/up of each pair's token, SiLU·mul: act [pairs, w] in sorted order.
    let (xq, xs) = super::quantize_rows(a.x)?;
    {
        let (xqs, xql) = xq.storage_and_layout();
        let (xss, xsl) = xs.storage_and_layout();
        let xq_v = view::<float8::F8E4M3>(&xqs, xql, OP, "quantized x", true)?;
        let xs_v = view::<f32>(&xss, xsl, OP, "x scales", false)?;
        if hopper {
            ws_fp8_launch(
                dev,
                suf,
                true,
                &mut act,
                &xq_v,
                &gu_v,
                Some(sorted_src),
                (tile_expert, tile_start, expert_end),
                max_tiles,
                2 * w,
                h,
                (&xs_v, &gu_s),
            )?;
        } else {
            let swiglu = kernel!(dev, Module::Moe, &format!("moe_gemm_fp8_swiglu_{tag}_{suf}"))?;
            let shape = gemm_shape(&swiglu, bm)?;
            let (n1, k1) = ((2 * w) as i32, h as i32);
            let mut b = swiglu.builder();
            b.arg(&mut act).arg(&xq_v).arg(&gu_v).arg(sorted_src).arg(tile_expert).arg(tile_start).arg(expert_end);
            b.arg(&n1).arg(&k1).arg(&k1).arg(&dense_rows).arg(&xs_v).arg(&gu_s);
            // SAFETY: argument list matches `moe_gemm_fp8_swiglu_*`; A rows come from sorted_src
            // (< tokens), whose scales xs holds; gu_s holds e × 2w scales.
            unsafe { b.launch(cfg(2 * w, shape)) }.w()?;
        }
    }

    // Down: y [pairs, h] in sorted order, A (act quantized) rows taken in place.
    let pairs = a.tokens * a.k;
    // The SwiGLU GEMM wrote every row of act that a tile covers, which is every sorted row of a
    // routed pair; rows past them (ids past the experts, on an expert-parallel rank) are
    // quantized but never read (no tile covers them).
    let act = wrap(act, dev, (pairs, w));
    let (aq, as_) = super::quantize_rows(&act)?;
    let (aqs, aql) = aq.storage_and_layout();
    let (ass, asl) = as_.storage_and_layout();
    let aq_v = view::<float8::F8E4M3>(&aqs, aql, OP, "quantized act", true)?;
    let as_v = view::<f32>(&ass, asl, OP, "act scales", false)?;
    if hopper {
        ws_fp8_launch(dev, suf, false, y, &aq_v, &down_v, None, (tile_expert, tile_start, expert_end), max_tiles, h, w, (&as_v, &d_s))?;
    } else {
        let plain = kernel!(dev, Module::Moe, &format!("moe_gemm_fp8_{tag}_{suf}"))?;
        let shape = gemm_shape(&plain, bm)?;
        let (n2, k2) = (h as i32, w as i32);
        let mut b = plain.builder();
        b.arg(y).arg(&aq_v).arg(&down_v).arg(&null).arg(tile_expert).arg(tile_start).arg(expert_end);
        b.arg(&n2).arg(&k2).arg(&k2).arg(&dense_rows).arg(&as_v).arg(&d_s);
        // SAFETY: argument list matches `moe_gemm_fp8_*`; a null row map reads A's sorted rows in
        // place, whose scales as_v holds; d_s holds e × h scales.
        unsafe { b.launch(cfg(h, shape)) }.w()?;
    }
    crate::ops::policy::count(|c| c.fp8_w8a8 += 2);
    Ok(())
}

/// One FP8 grouped GEMM on the warp-specialised Hopper kernel (`moe_wgmma_fp8_*`): `out` `[rows,
/// n]` (or `[rows, n / 2]` with `swiglu`) from E4M3 `a` (rows picked through `src`, or the sorted
/// rows in place) and E4M3 `weights` `[e, n, k]`, scaled by `a_scale` (a's rows) and `w_scale`
/// (`[e, n]`).
#[allow(clippy::too_many_arguments)]
fn ws_fp8_launch<T: DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    swiglu: bool,
    out: &mut CudaSlice<T>,
    a: &CudaView<float8::F8E4M3>,
    weights: &CudaView<float8::F8E4M3>,
    src: Option<&CudaSlice<u32>>,
    (tile_expert, tile_start, expert_end): (&CudaSlice<u32>, &CudaSlice<u32>, &CudaSlice<u32>),
    max_tiles: usize,
    n: usize,
    k: usize,
    (a_scale, w_scale): (&CudaView<f32>, &CudaView<f32>),
) -> Result<()> {
    const OP: &str = "moe_experts (fp8)";
    let stream = dev.cuda_stream();
    let e = weights.len() / (n * k).max(1);
    let (w_ptr, _w_guard) = weights.device_ptr(&stream);
    let map = weight_map(OP, DType::F8E4M3, w_ptr, e, n, k)?;
    let (a_ptr, _a_guard) = a.device_ptr(&stream);
    let src_guard = src.map(|s| s.device_ptr(&stream));
    let src_ptr: u64 = src_guard.as_ref().map_or(0, |(p, _)| *p);
    let name = if swiglu { "moe_wgmma_fp8_swiglu_" } else { "moe_wgmma_fp8_" };
    let func = kernel!(dev, Module::Moe, &format!("{name}{suf}"))?;
    let cfg = ws_config(&func, max_tiles * n.div_ceil(WS_BN_FP8), sm_count(dev)?, !swiglu, WS_BN_FP8)?;
    let (ni, ki, row_tiles) = (n as i32, k as i32, max_tiles as i32);
    let mut b = func.builder();
    b.arg(out).arg(&a_ptr).arg(&map).arg(&src_ptr);
    b.arg(tile_expert).arg(tile_start).arg(expert_end).arg(&ni).arg(&ki).arg(&ki).arg(&row_tiles).arg(&0i32).arg(&ki);
    b.arg(a_scale).arg(w_scale);
    // SAFETY: argument list matches `moe_wgmma_fp8_*` in moe.cu (one k slice, A rows k apart);
    // `map` describes the live weights [e · n, k]; `a` is a live [rows, k] matrix whose rows
    // `src` picks (each < tokens) or whose sorted rows are read in place (`src` null), with a
    // scale a row in `a_scale`; `w_scale` holds e × n scales.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Slices of a `k`-deep loop: about `wanted`, each at least `min_tiles` k tiles deep, each a
/// whole number of k tiles. Returns (slices, k columns per slice).
fn k_slices(k: usize, wanted: usize, min_tiles: usize) -> (usize, usize) {
    let slices = wanted.clamp(1, (k / (min_tiles * BK)).max(1));
    let chunk = k.div_ceil(slices).div_ceil(BK) * BK;
    (k.div_ceil(chunk), chunk)
}

/// Slices of the k loop for a persistent GEMM of `tiles` output tiles on `sms` CTAs: the count
/// (at most `max`) with the least time in units of one whole-k tile: the waves of tiles × slices
/// work items over the CTAs, each 1 / slices long, plus `per_slice` for each slice's f32 partial
/// sums (written and read back) when there is more than one.
fn persistent_slices(tiles: usize, sms: usize, max: usize, per_slice: f64) -> usize {
    let cost = |s: usize| (tiles * s).div_ceil(sms) as f64 / s as f64 + if s > 1 { per_slice * s as f64 } else { 0.0 };
    (1..=max.max(1)).min_by(|&a, &b| cost(a).total_cmp(&cost(b))).unwrap_or(1)
}

/// Router logits `[tokens, experts]` f32 of bf16 `x` `[tokens, hidden]` against f32 router
/// weights given as `split` `[experts, 3 · hidden]` bf16 (each row the weights' hi, mid and lo
/// bf16 parts side by side, `ops::moe::split_router`): one tensor-core GEMM whose products are
/// exact in f32 and whose sums run in f32 — an f32 matmul's accuracy at bf16 GEMM speed.
pub fn router_logits(x: &Tensor, split: &Tensor) -> Result<Tensor> {
    const OP: &str = "router_logits";
    let dev = device(x, OP)?;
    let x = x.contiguous()?;
    same_device_dtype(OP, DType::BF16, &x, &[("split", split)])?;
    let (tokens, h) = x.dims2()?;
    let (e, three_h) = split.dims2()?;
    if three_h != 3 * h || h == 0 || h % 64 != 0 || e == 0 || e % 8 != 0 || tokens > i32::MAX as usize {
        bail!("{OP} (cuda): x {:?} against split router {:?}", x.dims(), split.dims());
    }
    if tokens == 0 {
        return Tensor::zeros((0, e), DType::F32, x.device());
    }
    let (xs, xl) = x.storage_and_layout();
    let (ss, sl) = split.storage_and_layout();
    let x_v = view::<half::bf16>(&xs, xl, OP, "x", true)?;
    let s_v = view::<half::bf16>(&ss, sl, OP, "split", true)?;
    let sms = sm_count(&dev)?;
    // Hopper: the persistent warp-specialised GEMM (128 x 256 tiles), its k loop (3 × hidden
    // deep) cut into the slices `persistent_slices` finds cheapest, each at least
    // HOPPER_MIN_K_TILES deep. Elsewhere 64-row tiles, and slices until there are about three
    // blocks per SM (at least 8 k tiles).
    const HOPPER_MIN_K_TILES: usize = 4;
    let hopper = wgmma_available(&dev)?;
    // Row tiles of 64 tokens are the mma.sync grid's second dimension (at most 65535 blocks).
    if !hopper && tokens.div_ceil(64) > 65_535 {
        bail!("{OP} (cuda): {tokens} tokens need more than 65535 row tiles");
    }
    let (slices, k_chunk) = if hopper {
        let tiles = tokens.div_ceil(WS_BM) * e.div_ceil(WS_BN);
        // A slice's partial sums at 8,192 tokens × 256 experts (8 MB, written and read back:
        // ≈ 5.6 µs at the copy bandwidth) against ≈ 69 µs for a whole-k tile (H200 profile).
        let per_slice = 0.08 * (tokens * e) as f64 / (8192.0 * 256.0);
        k_slices(three_h, persistent_slices(tiles, sms, three_h / (HOPPER_MIN_K_TILES * BK), per_slice), HOPPER_MIN_K_TILES)
    } else {
        let tiles = tokens.div_ceil(64) * e.div_ceil(BN);
        k_slices(three_h, (3 * sms).div_ceil(tiles), 8)
    };
    // SAFETY: every (slice, token, expert) is written by the GEMM's epilogue, and the sum writes
    // every (token, expert).
    let mut out = unsafe { dev.alloc::<f32>(tokens * e)? };
    let mut parts = if slices > 1 { Some(unsafe { dev.alloc::<f32>(slices * tokens * e)? }) } else { None };
    let null = 0u64;
    let (n, k, a_cols, rows, chunk) = (e as i32, three_h as i32, h as i32, tokens as i32, k_chunk as i32);
    if hopper {
        let stream = dev.cuda_stream();
        let (s_ptr, _s_guard) = s_v.device_ptr(&stream);
        let map = weight_map(OP, DType::BF16, s_ptr, 1, e, three_h)?;
        let func = kernel!(dev, Module::Moe, "moe_wgmma_f32out_bf16")?;
        let row_tiles = tokens.div_ceil(WS_BM);
        let cfg = ws_config(&func, row_tiles * e.div_ceil(WS_BN) * slices, sms, false, WS_BN)?;
        let rt = row_tiles as i32;
        let mut b = func.builder();
        match &mut parts {
            Some(p) => b.arg(p),
            None => b.arg(&mut out),
        };
        b.arg(&x_v).arg(&map).arg(&null).arg(&null).arg(&null).arg(&null);
        b.arg(&n).arg(&k).arg(&a_cols).arg(&rt).arg(&rows).arg(&chunk);
        // SAFETY: argument list matches `moe_wgmma_f32out_bf16`; `map` describes the live split
        // weights [e, 3h]; null tiles cut the one dense matrix, slice z writing rows
        // [z * tokens, (z + 1) * tokens) of parts.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
    } else {
        let func = kernel!(dev, Module::Moe, "moe_gemm_f32out_bm64_bf16")?;
        let (threads, smem) = gemm_shape(&func, 64)?;
        let cfg =
            LaunchConfig { grid_dim: (e.div_ceil(BN) as u32, tokens.div_ceil(64) as u32, slices as u32), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let mut b = func.builder();
        match &mut parts {
            Some(p) => b.arg(p),
            None => b.arg(&mut out),
        };
        b.arg(&x_v).arg(&s_v).arg(&null).arg(&null).arg(&null).arg(&null);
        b.arg(&n).arg(&k).arg(&a_cols).arg(&rows).arg(&chunk);
        // SAFETY: argument list matches `moe_gemm_f32out_*`; null tiles cut the one dense matrix,
        // slice z writing rows [z * tokens, (z + 1) * tokens) of parts.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
    }
    if let Some(parts) = &parts {
        let total = (tokens * e) as i64;
        let si = slices as i32;
        let sum = kernel!(dev, Module::Moe, "moe_sum_slices")?;
        let cfg = LaunchConfig { grid_dim: ((tokens * e / 4).div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = sum.builder();
        b.arg(&mut out).arg(parts).arg(&si).arg(&total);
        // SAFETY: argument list matches `moe_sum_slices`; tokens * e is a multiple of 4 (e % 8 == 0).
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
    }
    Ok(wrap(out, &dev, (tokens, e)))
}
