//! The CUDA side of FP8 linear layers (`kernels/fp8.cu`): the weight-only kernels for launches
//! of at most [`FP8_MMA_MAX_ROWS`] rows (the tensor-core kernel; the SIMT one at most
//! [`FP8_MAX_ROWS`]), where the layer is memory-bound and reading a byte a weight instead of two
//! is the whole gain; and the per-row quantization of the activations
//! that the W8A8 GEMM (`fp8_gemm.rs`) multiplies.

use super::launch::{device, for_float, kernel, same_device, same_device_dtype, view, wrap, Dest, Module};
use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// Most rows of x the SIMT kernel takes (`FP8_MAX_ROWS` in fp8.cu).
pub const FP8_MAX_ROWS: usize = 16;
/// Most rows of x the tensor-core kernel takes (`FP8_MMA_MAX_ROWS` in fp8.cu): four m16 tiles.
pub const FP8_MMA_MAX_ROWS: usize = crate::ops::policy::FP8_WEIGHT_ONLY_MAX_ROWS;

/// Most rows of x [`fp8_linear`] takes for `dtype`, on the tensor-core kernel (`mma`, bf16 /
/// f16) or the SIMT one.
pub fn fp8_linear_max_rows(dtype: DType, mma: bool) -> usize {
    if mma && matches!(dtype, DType::BF16 | DType::F16) {
        FP8_MMA_MAX_ROWS
    } else {
        FP8_MAX_ROWS
    }
}

/// How an FP8 weight's values are scaled back, for [`fp8_linear`].
#[derive(Debug, Clone, Copy)]
pub enum WeightScale<'a> {
    /// One f32 scale per output row, `[n]`.
    Rows(&'a Tensor),
    /// One f32 scale per `block.0 × block.1` tile, `[ceil(n / block.0), ceil(k / block.1)]`
    /// (block.1 a multiple of 16; the tensor-core kernel only).
    Blocks { scale: &'a Tensor, block: (usize, usize) },
}

/// `x Wᵀ (+ bias)` for `x` `[rows, k]` (rows ≤ [`fp8_linear_max_rows`], bf16 / f16 / f32), `data`
/// `[n, k]` E4M3 scaled by `scale`, `bias` `[n]` in x's dtype; k a multiple of 16. The SIMT
/// kernel (f32, or `mma` off) equals the dense matmul over `T(data · scale)` up to the order of
/// the f32 sums; the tensor-core kernel (bf16 / f16 with `mma`) applies a row's scale to the sum
/// instead of to each weight, and a block's scale to each weight as the reference does.
pub fn fp8_linear(x: &Tensor, data: &Tensor, scale: WeightScale, bias: Option<&Tensor>, mma: bool) -> Result<Tensor> {
    let mma = mma && matches!(x.dtype(), DType::BF16 | DType::F16);
    let p = Fp8Product::check(x, data, scale, bias, fp8_linear_max_rows(x.dtype(), mma), mma)?;
    let bias = bias.map(Tensor::contiguous).transpose()?;
    let dev = device(x, OP)?;
    for_float!(x.dtype(), OP, |T, suf| fp8_linear_launch::<T>(&dev, suf, mma, &p, bias.as_ref()))
}

/// The tensor-core product of [`fp8_linear`] (bf16 / f16 `x`, no bias) as `splits` partial
/// products over consecutive k slices, each scaled and left in f32: `[splits, rows, n]`, into
/// `given` where that is of this length (a decode arena's buffer), else a new tensor. Summed in
/// slice order they are the product before its rounding; a norm-fed projection's partials go to
/// `norm_of_partials`, as split bf16 products do. A slice is a run of 64-wide chunks of k.
pub fn fp8_linear_partials(x: &Tensor, data: &Tensor, scale: WeightScale, splits: usize, given: Option<&Tensor>) -> Result<Tensor> {
    if !matches!(x.dtype(), DType::BF16 | DType::F16) {
        bail!("{OP} (cuda): split products take bf16 / f16, not {:?}", x.dtype());
    }
    let p = Fp8Product::check(x, data, scale, None, FP8_MMA_MAX_ROWS, true)?;
    if splits == 0 || splits > p.k.div_ceil(64) {
        bail!("{OP} (cuda): {splits} k slices over k = {} (1 ..= k / 64 rounded up)", p.k);
    }
    // Its length and layout `Dest` checks.
    if let Some(t) = given {
        same_device_dtype(OP, DType::F32, x, &[("parts", t)])?;
    }
    let dev = device(x, OP)?;
    match x.dtype() {
        DType::BF16 => fp8_partials_launch::<half::bf16>(&dev, "bf16", &p, splits, given),
        _ => fp8_partials_launch::<half::f16>(&dev, "f16", &p, splits, given),
    }
}

const OP: &str = "fp8_linear";

/// A product's operands, checked and contiguous.
struct Fp8Product {
    x: Tensor,
    data: Tensor,
    scale: Tensor,
    block: (usize, usize),
    rows: usize,
    n: usize,
    k: usize,
}

impl Fp8Product {
    /// `mma`: the tensor-core kernel takes the product (block scales need it).
    fn check(x: &Tensor, data: &Tensor, scale: WeightScale, bias: Option<&Tensor>, max_rows: usize, mma: bool) -> Result<Self> {
        let (rows, k) = x.dims2()?;
        let (n, k_w) = data.dims2()?;
        if k != k_w || k % 16 != 0 || rows == 0 || rows > max_rows || n == 0 || n > i32::MAX as usize || k > i32::MAX as usize {
            bail!("{OP} (cuda): x [{rows}, {k}] against a weight [{n}, {k_w}]: needs equal k, a multiple of 16, output columns, and 1..={max_rows} rows");
        }
        let (scale, block) = match scale {
            WeightScale::Rows(s) => (s, (0, 0)),
            WeightScale::Blocks { scale, block } => (scale, block),
        };
        let scale_dims = if block.0 == 0 { vec![n] } else { vec![n.div_ceil(block.0.max(1)), k.div_ceil(block.1.max(1))] };
        if data.dtype() != DType::F8E4M3 || scale.dtype() != DType::F32 || scale.dims() != scale_dims {
            bail!("{OP} (cuda): weight {:?} with scales {:?} {:?}: needs E4M3 and {scale_dims:?} f32", data.dtype(), scale.dims(), scale.dtype());
        }
        if block.0 > 0 && (!mma || block.1 == 0 || block.1 % 16 != 0 || block.0 > i32::MAX as usize || block.1 > i32::MAX as usize) {
            bail!("{OP} (cuda): {block:?} blocks need the tensor-core kernel (bf16 / f16) and a multiple of 16 columns");
        }
        if let Some(b) = bias.filter(|b| b.dims() != [n] || b.dtype() != x.dtype()) {
            bail!("{OP} (cuda): bias {:?} {:?}, expected [{n}] {:?}", b.dims(), b.dtype(), x.dtype());
        }
        same_device(OP, x, &[("weight", data), ("scales", scale)])?;
        if let Some(b) = bias {
            same_device(OP, x, &[("bias", b)])?;
        }
        Ok(Self { x: x.contiguous()?, data: data.contiguous()?, scale: scale.contiguous()?, block, rows, n, k })
    }

    /// `f` over the device views of x (as `T`), the weight and its scales.
    fn with_views<T: CudaDType + DeviceRepr, R>(&self, f: impl FnOnce(&CudaView<T>, &CudaView<float8::F8E4M3>, &CudaView<f32>) -> Result<R>) -> Result<R> {
        let (xs, xl) = self.x.storage_and_layout();
        let (ws, wl) = self.data.storage_and_layout();
        let (ss, sl) = self.scale.storage_and_layout();
        f(&view::<T>(&xs, xl, OP, "x", true)?, &view::<float8::F8E4M3>(&ws, wl, OP, "weight", true)?, &view::<f32>(&ss, sl, OP, "scale", false)?)
    }
}

fn fp8_linear_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, mma: bool, p: &Fp8Product, bias: Option<&Tensor>) -> Result<Tensor> {
    p.with_views::<T, _>(|x_v, w_v, s_v| fp8_linear_views(dev, suf, mma, p, (x_v, w_v, s_v), bias))
}

fn fp8_linear_views<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    mma: bool,
    p: &Fp8Product,
    (x_v, w_v, s_v): (&CudaView<T>, &CudaView<float8::F8E4M3>, &CudaView<f32>),
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let bias_storage = bias.map(|b| b.storage_and_layout());
    let b_v = bias_storage.as_ref().map(|(st, l)| view::<T>(st, l, OP, "bias", false)).transpose()?;
    // A null pointer for no bias (the kernel checks it).
    let b_ptr = b_v.as_ref().map(|v| v.device_ptr(&stream));
    let bias_arg: u64 = b_ptr.as_ref().map_or(0, |(p, _)| *p);
    let (rows, n) = (p.rows, p.n);
    // SAFETY: the kernel writes every element of the output ([rows, n]).
    let mut out = unsafe { dev.alloc::<T>(rows * n)? };
    // Eight warps a block either way: the tensor-core kernel's block takes 16 output columns
    // (its warps share k) in as few m16 tiles as hold the rows, the SIMT kernel's a column a warp.
    // The pipelined tensor-core form takes its warps' rings of weight chunks as dynamic shared
    // memory.
    let pipe = mma && crate::ops::policy::current().fp8_pipeline;
    let tiles = rows.div_ceil(16).next_power_of_two();
    let (name, cols, smem) = match (mma, pipe) {
        (true, true) => (format!("fp8_linear_mma_pipe_m{tiles}_{suf}"), 16, crate::ops::linear::FP8_PIPE_SMEM_BYTES),
        (true, false) => (format!("fp8_linear_mma_m{tiles}_{suf}"), 16, 0),
        (false, _) => (format!("fp8_linear_{suf}"), 8, 0),
    };
    let func = kernel!(dev, Module::Fp8, &name)?;
    // The pipelined kernel's blocks are persistent: as many as the GPU holds at once, each taking
    // every gridDim-th tile of 16 columns.
    let col_tiles = n.div_ceil(cols);
    let per_sm = || Ok(func.occupancy_max_active_blocks_per_multiprocessor(256, smem as usize, None).w()? as usize);
    let blocks = if pipe { col_tiles.min(super::launch::resident_blocks(dev, &name, (256, smem as usize), per_sm)?) } else { col_tiles };
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: smem };
    let (r, nn, kk) = (rows as i32, n as i32, p.k as i32);
    let mut b = func.builder();
    let (block_rows, block_cols) = (p.block.0 as i32, p.block.1 as i32);
    b.arg(&mut out).arg(x_v).arg(w_v).arg(s_v).arg(&bias_arg).arg(&r).arg(&nn).arg(&kk);
    if mma {
        b.arg(&block_rows).arg(&block_cols);
    }
    // SAFETY: argument list matches `fp8_linear_*` and `fp8_linear_mma_*` (with the block shape)
    // in fp8.cu; x holds rows × k, the weight n × k bytes (16-byte aligned: checked by `view`),
    // the scales n values or one a block, the bias n values, all on this device's stream.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    drop(b_ptr);
    crate::ops::policy::count(|c| c.fp8_weight_only_pipelined += u64::from(pipe));
    Ok(wrap(out, dev, (rows, n)))
}

fn fp8_partials_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, p: &Fp8Product, splits: usize, given: Option<&Tensor>) -> Result<Tensor> {
    p.with_views::<T, _>(|x_v, w_v, s_v| fp8_partials_views(dev, suf, p, (x_v, w_v, s_v), splits, given))
}

fn fp8_partials_views<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    p: &Fp8Product,
    (x_v, w_v, s_v): (&CudaView<T>, &CudaView<float8::F8E4M3>, &CudaView<f32>),
    splits: usize,
    given: Option<&Tensor>,
) -> Result<Tensor> {
    let (rows, n) = (p.rows, p.n);
    let given_sl = given.map(|t| t.storage_and_layout());
    // SAFETY: the kernel writes every element of every slice: each block its 16 columns of every
    // row (zeros for a slice whose run of chunks is empty).
    let mut out = unsafe { Dest::<f32>::new(dev, splits * rows * n, given_sl.as_ref().map(|(s, l)| (&**s, *l)), OP, "parts")? };
    let tiles = rows.div_ceil(16).next_power_of_two();
    let func = kernel!(dev, Module::Fp8, &format!("fp8_linear_mma_parts_m{tiles}_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (n.div_ceil(16) as u32, splits as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (r, nn, kk) = (rows as i32, n as i32, p.k as i32);
    let (block_rows, block_cols) = (p.block.0 as i32, p.block.1 as i32);
    {
        let mut b = func.builder();
        out.push(&mut b);
        b.arg(x_v).arg(w_v).arg(s_v).arg(&r).arg(&nn).arg(&kk).arg(&block_rows).arg(&block_cols);
        // SAFETY: argument list matches `fp8_linear_mma_parts_*` in fp8.cu; the partials hold
        // splits × rows × n f32, x rows × k, the weight n × k bytes, the scales n values or one a
        // block, all on this device's stream.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(out.finish(dev, (splits, rows, n), given))
}

/// `x` `[rows, k]` (bf16 / f16 / f32) quantized a row at a time: E4M3 `[rows, k]` and the f32
/// scales `[rows]`, bit for bit [`crate::quant::Fp8Weight::quantize`] of `x`.
pub fn quantize_rows(x: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "quantize_rows";
    let dev = device(x, OP)?;
    let (rows, k) = x.dims2()?;
    if rows == 0 || k == 0 || rows > i32::MAX as usize || k > i32::MAX as usize {
        bail!("{OP} (cuda): x [{rows}, {k}] is empty or too large");
    }
    let x = x.contiguous()?;
    for_float!(x.dtype(), OP, |T, suf| quantize_rows_launch::<T>(&dev, suf, &x, rows, k))
}

fn quantize_rows_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, x: &Tensor, rows: usize, k: usize) -> Result<(Tensor, Tensor)> {
    const OP: &str = "quantize_rows";
    let (xs, xl) = x.storage_and_layout();
    let x_v = view::<T>(&xs, xl, OP, "x", false)?;
    // SAFETY: the kernel writes every value of `q` and every scale.
    let mut q = unsafe { dev.alloc::<float8::F8E4M3>(rows * k)? };
    let mut scale = unsafe { dev.alloc::<f32>(rows)? };
    let func = kernel!(dev, Module::Fp8, &format!("quantize_rows_{suf}"))?;
    // A block a row; 256 threads cover the widest rows (k up to tens of thousands) in a few
    // strided passes.
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let kk = k as i32;
    let mut b = func.builder();
    b.arg(&mut q).arg(&mut scale).arg(&x_v).arg(&kk);
    // SAFETY: argument list matches `quantize_rows_*` in fp8.cu; x holds rows × k values, q
    // rows × k bytes and scale rows floats, all on this device's stream.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok((wrap(q, dev, (rows, k)), wrap(scale, dev, rows)))
}

/// Threads a block and most blocks of the element-wise casts (a grid-stride loop covers the rest).
const CAST_BLOCK: u32 = 256;
const CAST_MAX_BLOCKS: usize = 1 << 16;

fn cast_config(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(CAST_BLOCK as usize).clamp(1, CAST_MAX_BLOCKS) as u32, 1, 1), block_dim: (CAST_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// E4M3 `q` as `dtype` (bf16 / f16 / f32), each row of its last dimension times its f32 `scale`
/// (`[rows]`, one per row) where given: `dtype(e4m3 · scale)` in f32, as the CPU computes it.
pub fn e4m3_to(q: &Tensor, scale: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
    const OP: &str = "e4m3_to";
    let dev = device(q, OP)?;
    if q.dtype() != DType::F8E4M3 {
        bail!("{OP} (cuda): input is {:?}, not E4M3", q.dtype());
    }
    let n = q.elem_count();
    let k = q.dims().last().copied().unwrap_or(1).max(1);
    if let Some(s) = scale.filter(|s| s.dtype() != DType::F32 || s.elem_count() * k != n) {
        bail!("{OP} (cuda): scales {:?} {:?} for {:?}: needs one f32 a row", s.dims(), s.dtype(), q.dims());
    }
    if n == 0 {
        return Tensor::zeros(q.shape(), dtype, q.device());
    }
    let (q, scale) = (q.contiguous()?, scale.map(Tensor::contiguous).transpose()?);
    for_float!(dtype, OP, |T, suf| e4m3_to_launch::<T>(&dev, suf, &q, scale.as_ref(), k, n))
}

fn e4m3_to_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, q: &Tensor, scale: Option<&Tensor>, k: usize, n: usize) -> Result<Tensor> {
    const OP: &str = "e4m3_to";
    let stream = dev.cuda_stream();
    let (qs, ql) = q.storage_and_layout();
    let q_v = view::<float8::F8E4M3>(&qs, ql, OP, "q", false)?;
    let scale_storage = scale.map(|s| s.storage_and_layout());
    let s_v = scale_storage.as_ref().map(|(st, l)| view::<f32>(st, l, OP, "scale", false)).transpose()?;
    // A null pointer for no scale (the kernel checks it).
    let s_ptr = s_v.as_ref().map(|v| v.device_ptr(&stream));
    let scale_arg: u64 = s_ptr.as_ref().map_or(0, |(p, _)| *p);
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<T>(n)? };
    let func = kernel!(dev, Module::Fp8, &format!("e4m3_to_{suf}"))?;
    let (kk, nn) = (k as i64, n as i64);
    let mut b = func.builder();
    b.arg(&mut out).arg(&q_v).arg(&scale_arg).arg(&kk).arg(&nn);
    // SAFETY: argument list matches `e4m3_to_*` in fp8.cu; q holds n bytes, out n values, the
    // scales n / k floats, on this device's stream.
    unsafe { b.launch(cast_config(n)) }.w()?;
    drop(b);
    drop(s_ptr);
    Ok(wrap(out, dev, q.shape().clone()))
}

/// f32 `x` rounded to E4M3 (ties to even, saturating at ±448; the callers clamp first).
pub fn e4m3_from_f32(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "e4m3_from_f32";
    let dev = device(x, OP)?;
    if x.dtype() != DType::F32 {
        bail!("{OP} (cuda): input is {:?}, not f32", x.dtype());
    }
    let n = x.elem_count();
    if n == 0 {
        return Tensor::zeros(x.shape(), DType::F8E4M3, x.device());
    }
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let x_v = view::<f32>(&xs, xl, OP, "x", false)?;
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<float8::F8E4M3>(n)? };
    let func = kernel!(dev, Module::Fp8, "e4m3_from_f32")?;
    let nn = n as i64;
    let mut b = func.builder();
    b.arg(&mut out).arg(&x_v).arg(&nn);
    // SAFETY: argument list matches `e4m3_from_f32` in fp8.cu; x and out hold n values on this
    // device's stream.
    unsafe { b.launch(cast_config(n)) }.w()?;
    drop(b);
    Ok(wrap(out, &dev, x.shape().clone()))
}
