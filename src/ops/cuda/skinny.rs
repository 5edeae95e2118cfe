//! The decode-width GEMM (`kernels/skinny.cu`): `x · wᵀ` for at most 64 rows, weights streamed
//! once into registers, k split across the blocks of a thread-block cluster when the columns
//! give too few blocks, and an optional SiLU·mul epilogue for fused gate/up weights. Needs
//! Hopper (clusters): only on sm_90 builds. Entry points in `crate::ops::linear`.

use super::launch::{device, kernel, same_device_dtype, view, wrap, Module};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

use crate::ops::linear::{SkinnyPlan, MAX_ROWS, WARPS};

/// Whether [`skinny_linear`] takes these shapes: `x` `[M, K]` with 1 ≤ M ≤ 64 and `w` `[N, K]`
/// in bf16 or f16, K a multiple of 8 whose slices fit shared memory, N a multiple of 16, on an
/// sm_90 build.
pub fn skinny_fits(x: &Tensor, w: &Tensor, silu_pairs: bool) -> bool {
    let (Ok((m, k)), Ok((n, kw))) = (x.dims2(), w.dims2()) else { return false };
    // Whether x's k slice fits shared memory does not depend on the SM count.
    let (out_cols, cols_per_group) = if silu_pairs { (n / 2, WARPS * 8) } else { (n, WARPS * 16) };
    cfg!(ponder_wgmma)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && (1..=MAX_ROWS).contains(&m)
        && k == kw
        && k % 8 == 0
        && k > 0
        && n % 16 == 0
        && n > 0
        && n * k < i32::MAX as usize
        && SkinnyPlan::new(m, out_cols, cols_per_group, k, 132).is_some()
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

fn launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, x: &Tensor, w: &Tensor, silu_pairs: bool) -> Result<Tensor> {
    const OP: &str = "skinny_linear";
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let out_cols = if silu_pairs { n / 2 } else { n };
    let cols_per_group = WARPS * if silu_pairs { 8 } else { 16 };
    let sms = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize;
    let Some(plan) = SkinnyPlan::new(m, out_cols, cols_per_group, k, sms) else {
        bail!("{OP} (cuda): x's k slice ({k}) does not fit shared memory at {m} rows");
    };
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let x_v = view::<T>(&xs, xl, OP, "x", true)?;
    let w_v = view::<T>(&ws, wl, OP, "w", true)?;
    // SAFETY: every (row < m, column < out_cols) is written: by its group's only block, or by
    // one block of the group's cluster after the partials are summed.
    let mut y = unsafe { dev.alloc::<T>(m * out_cols)? };
    let func = kernel!(dev, Module::Skinny, &format!("skinny_gemm_{suf}_m{}_s{}", plan.m_tiles, plan.splits))?;
    let smem = plan.smem_bytes();
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    let cfg = LaunchConfig { grid_dim: (plan.groups as u32, plan.splits as u32, 1), block_dim: ((WARPS * 32) as u32, 1, 1), shared_mem_bytes: smem as u32 };
    let (mi, ni, ki, cps, pairs) = (m as i32, n as i32, k as i32, plan.chunks_per_split as i32, if silu_pairs { out_cols as i32 } else { 0 });
    let mut b = func.builder();
    b.arg(&mut y).arg(&x_v).arg(&w_v).arg(&mi).arg(&ni).arg(&ki).arg(&cps).arg(&pairs);
    // SAFETY: argument list matches `skinny_gemm_*` in skinny.cu; shapes checked by skinny_fits,
    // 16-byte alignment by the views; grid y equals the kernel's cluster size.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(wrap(y, dev, (m, out_cols)))
}
