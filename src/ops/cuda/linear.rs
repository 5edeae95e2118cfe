//! Skinny decode GEMMs (`kernels/linear.cu`): `x · W^T` for at most 64 rows of `x`, over W's row
//! tiles and, where those are too few to keep every SM streaming, over slices of K with an
//! ordered reduction. Entry point in `crate::ops::linear`.

use super::launch::{device, kernel, same_device_dtype, view, wrap, Module};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// Rows of `x` the kernel takes (one 64-row tile).
pub const MAX_ROWS: usize = 64;
/// Row tile of W, k tile and pipeline stages (kernel constants `BN`, `BK`, `STAGES`).
const BN: usize = 128;
const BK: usize = 64;
const STAGES: usize = 3;

/// `x` `[rows, K]` · `w` `[N, K]`^T → `[rows, N]`, rows ≤ [`MAX_ROWS`], K and N multiples of 8.
pub fn linear_skinny(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    const OP: &str = "linear_skinny";
    let dev = device(x, OP)?;
    let x = x.contiguous()?;
    same_device_dtype(OP, x.dtype(), &x, &[("w", w)])?;
    let (rows, k) = x.dims2()?;
    let (n, wk) = w.dims2()?;
    if wk != k || rows == 0 || rows > MAX_ROWS || k % 8 != 0 || n % 8 != 0 || n * k > i32::MAX as usize || !w.is_contiguous() {
        bail!("{OP} (cuda): x {:?} against w {:?}", x.dims(), w.dims());
    }
    match x.dtype() {
        DType::BF16 => launch::<half::bf16>(&dev, "bf16", &x, w, rows, n, k),
        DType::F16 => launch::<half::f16>(&dev, "f16", &x, w, rows, n, k),
        d => bail!("{OP} (cuda): dtype {d:?} (bf16 or f16)"),
    }
}

/// Slices of K: enough blocks for about three per SM, each slice at least 4 k tiles deep (a
/// shorter loop spends its time filling the pipeline).
fn k_slices(dev: &CudaDevice, n: usize, k: usize) -> Result<usize> {
    let sms = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize;
    let tiles = n.div_ceil(BN);
    let wanted = (3 * sms).div_ceil(tiles);
    Ok(wanted.clamp(1, (k / (4 * BK)).max(1)))
}

fn launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, x: &Tensor, w: &Tensor, rows: usize, n: usize, k: usize) -> Result<Tensor> {
    const OP: &str = "linear_skinny";
    let slices = k_slices(dev, n, k)?;
    let k_chunk = k.div_ceil(slices).div_ceil(BK) * BK;
    let slices = k.div_ceil(k_chunk);
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let x_v = view::<T>(&xs, xl, OP, "x", true)?;
    let w_v = view::<T>(&ws, wl, OP, "w", true)?;
    let smem = STAGES * (64 + BN) * BK * 2;
    let cfg = LaunchConfig { grid_dim: (1, n.div_ceil(BN) as u32, slices as u32), block_dim: (128, 1, 1), shared_mem_bytes: smem as u32 };
    let (ni, ki, ri, ci) = (n as i32, k as i32, rows as i32, k_chunk as i32);
    // SAFETY: the GEMM writes every (row, column) of its output (every slice's, when split).
    let mut out = unsafe { dev.alloc::<T>(rows * n)? };
    if slices == 1 {
        let func = kernel!(dev, Module::Linear, &format!("linear_skinny_{suf}"))?;
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
        let mut b = func.builder();
        b.arg(&mut out).arg(&x_v).arg(&w_v).arg(&ni).arg(&ki).arg(&ri);
        // SAFETY: argument list matches `linear_skinny_*` in linear.cu; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
    } else {
        let mut parts = unsafe { dev.alloc::<f32>(slices * rows * n)? };
        let func = kernel!(dev, Module::Linear, &format!("linear_skinny_splitk_{suf}"))?;
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
        let mut b = func.builder();
        b.arg(&mut parts).arg(&x_v).arg(&w_v).arg(&ni).arg(&ki).arg(&ri).arg(&ci);
        // SAFETY: argument list matches `linear_skinny_splitk_*`; slice z writes parts[z].
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        let total = (rows * n) as i64;
        let (si, threads) = (slices as i32, 256u32);
        let reduce = kernel!(dev, Module::Linear, &format!("splitk_reduce_{suf}"))?;
        let cfg = LaunchConfig { grid_dim: ((total as usize / 4).div_ceil(threads as usize) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let mut b = reduce.builder();
        b.arg(&mut out).arg(&parts).arg(&si).arg(&total);
        // SAFETY: argument list matches `splitk_reduce_*`; rows * n is a multiple of 4 (n % 8 == 0).
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
    }
    Ok(wrap(out, dev, (rows, n)))
}
