//! The decode-width GEMM (`kernels/skinny.cu`): `x · wᵀ` for at most [`MAX_ROWS`] rows, weights
//! streamed once into registers, k split across blocks when the columns give too few of them,
//! and an optional SiLU·mul epilogue for fused gate/up weights. Entry points in
//! `crate::ops::linear`.

use super::launch::{device, kernel, same_device_dtype, view, wrap, Module};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUstreamCaptureStatus};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::ops::linear::{SkinnyPlan, CHUNK, MAX_ROWS, SMEM_MAX, WARPS};
/// Column groups a split launch may have (one counter each).
const COUNTERS: usize = 1 << 14;

/// Whether [`skinny_linear`] takes these shapes: `x` `[M, K]` with 1 ≤ M ≤ 64 and `w` `[N, K]`
/// in bf16 or f16, K a multiple of 8, N a multiple of 16 (with `silu_pairs`, N / 2 a multiple of
/// 8).
pub fn skinny_fits(x: &Tensor, w: &Tensor, _silu_pairs: bool) -> bool {
    let (Ok((m, k)), Ok((n, kw))) = (x.dims2(), w.dims2()) else { return false };
    matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && (1..=MAX_ROWS).contains(&m)
        && k == kw
        && k % 8 == 0
        && k > 0
        && n % 16 == 0
        && n > 0
        && n * k < i32::MAX as usize
}

/// `x · wᵀ` (`[M, N]`), or with `silu_pairs` `silu(x · gateᵀ) · (x · upᵀ)` (`[M, N / 2]`) for
/// `w` = gate rows then up rows. Shapes as [`skinny_fits`] says; f32 accumulation.
pub fn skinny_linear(x: &Tensor, w: &Tensor, silu_pairs: bool) -> Result<Tensor> {
    const OP: &str = "skinny_linear";
    let dev = device(x, OP)?;
    same_device_dtype(OP, x.dtype(), x, &[("w", w)])?;
    if !skinny_fits(x, w, silu_pairs) {
        bail!("{OP} (cuda): x {:?} {:?} and w {:?} {:?} are not shapes it takes", x.dims(), x.dtype(), w.dims(), w.dtype());
    }
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    match x.dtype() {
        DType::BF16 => launch::<half::bf16>(&dev, "bf16", &x, &w, silu_pairs),
        DType::F16 => launch::<half::f16>(&dev, "f16", &x, &w, silu_pairs),
        d => bail!("{OP} (cuda): dtype {d:?}"),
    }
}

/// Per device, the split launches' column-group counters: zero between launches (the last
/// block of a group resets its counter), so allocated once, before any graph capture uses it.
fn counters(dev: &CudaDevice) -> Result<Option<CudaSlice<u32>>> {
    static ALL: OnceLock<Mutex<HashMap<candle_core::cuda_backend::DeviceId, CudaSlice<u32>>>> = OnceLock::new();
    let mut all = ALL.get_or_init(Default::default).lock().map_err(|_| candle_core::Error::Msg("skinny counters lock poisoned".into()))?;
    if let Some(c) = all.get(&dev.id()) {
        return Ok(Some(c.clone()));
    }
    // An allocation inside a capture would belong to the graph; the caller falls back instead.
    if dev.cuda_stream().capture_status().w()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(None);
    }
    let c = dev.cuda_stream().alloc_zeros::<u32>(COUNTERS).w()?;
    all.insert(dev.id(), c.clone());
    Ok(Some(c))
}

fn launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, x: &Tensor, w: &Tensor, silu_pairs: bool) -> Result<Tensor> {
    const OP: &str = "skinny_linear";
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let out_cols = if silu_pairs { n / 2 } else { n };
    let cols_per_group = WARPS * if silu_pairs { 8 } else { 16 };
    let sms = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize;
    let mut plan = SkinnyPlan::new(m, out_cols, cols_per_group, k, sms);
    let counters = match plan.splits > 1 && plan.groups <= COUNTERS {
        true => counters(dev)?,
        false => None,
    };
    if plan.splits > 1 && counters.is_none() {
        // No counters (too many groups, or first use inside a capture): one split per group.
        plan.chunks_per_split = k.div_ceil(CHUNK);
        plan.splits = 1;
        if plan.smem_bytes() > SMEM_MAX {
            return x.matmul(&w.t()?).and_then(|y| if silu_pairs { crate::ops::silu_mul(&y) } else { Ok(y) });
        }
    }
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let x_v = view::<T>(&xs, xl, OP, "x", true)?;
    let w_v = view::<T>(&ws, wl, OP, "w", true)?;
    // SAFETY: every (row < m, column < out_cols) is written: by its group's only block, or by the
    // group's last block after all splits wrote their partials.
    let mut y = unsafe { dev.alloc::<T>(m * out_cols)? };
    let gcols = WARPS * 16;
    let mut partials = match plan.splits {
        1 => None,
        // SAFETY: each split writes its rows and columns before the last block reads them.
        s => Some(unsafe { dev.alloc::<f32>(plan.groups * s * m * gcols)? }),
    };
    let func = kernel!(dev, Module::Skinny, &format!("skinny_gemm_{suf}_m{}", plan.m_tiles))?;
    let smem = plan.smem_bytes();
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    let cfg = LaunchConfig { grid_dim: (plan.groups as u32, plan.splits as u32, 1), block_dim: ((WARPS * 32) as u32, 1, 1), shared_mem_bytes: smem as u32 };
    let (mi, ni, ki, cps, pairs) = (m as i32, n as i32, k as i32, plan.chunks_per_split as i32, if silu_pairs { out_cols as i32 } else { 0 });
    let null = 0u64;
    let mut b = func.builder();
    b.arg(&mut y).arg(&x_v).arg(&w_v);
    match (&mut partials, &counters) {
        (Some(p), Some(c)) => b.arg(p).arg(c),
        _ => b.arg(&null).arg(&null),
    };
    b.arg(&mi).arg(&ni).arg(&ki).arg(&cps).arg(&pairs);
    // SAFETY: argument list matches `skinny_gemm_*` in skinny.cu; shapes checked by skinny_fits,
    // 16-byte alignment by the views; partials and counters are passed whenever splits > 1.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(wrap(y, dev, (m, out_cols)))
}
