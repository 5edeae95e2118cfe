//! FOCUS's importance kernels (`kernels/focus.cu`); the host policy is `diffusion::eviction`.

use super::launch::{device, for_float, kernel, same_device_dtype, view, wrap, Module};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// FOCUS importance of each row's masked tokens (see `kernels/focus.cu`): `q` `[T, H, D]`, `k`
/// `[T, KV, D]` of the launch's tokens, `gather` `[R * m]` u32 token indices of each row's
/// masked tokens padded to `m` (at most 32), `lens` `[R]` u32 → `[R, m]` f32, rounded through
/// the dtype of `q`. Deterministic (fixed summation order).
pub fn focus_importance(q: &Tensor, k: &Tensor, gather: &Tensor, lens: &Tensor, m: usize) -> Result<Tensor> {
    const OP: &str = "focus_importance";
    let dev = device(q, OP)?;
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
    for_float!(dtype, OP, |T, suf| focus_launch::<T>(&dev, suf, &q, &k, gather, lens, rows, m, heads, kvh, d))
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
    let q_v = view::<T>(&qs, ql, OP, "q", false)?;
    let k_v = view::<T>(&ks, kl, OP, "k", false)?;
    let g_v = view::<u32>(&gs, gl, OP, "gather", false)?;
    let l_v = view::<u32>(&ls, ll, OP, "lens", false)?;
    // SAFETY: pass 1 writes every element of [rows, heads, m], pass 2 every element of [rows, m].
    let mut partial = unsafe { dev.alloc::<f32>(rows * heads * m)? };
    let mut out = unsafe { dev.alloc::<f32>(rows * m)? };
    let (mm, h, g, dd, scale) = (m as i32, heads as i32, kvh as i32, d as i32, 1.0f32 / (d as f32).sqrt());
    let func = kernel!(dev, Module::Focus, &format!("focus_importance_heads_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, heads as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    b.arg(&mut partial).arg(&q_v).arg(&k_v).arg(&g_v).arg(&l_v).arg(&mm).arg(&h).arg(&g).arg(&dd).arg(&scale);
    // SAFETY: argument list matches `focus_importance_heads_*` in focus.cu; sizes checked by the caller.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    let func = kernel!(dev, Module::Focus, &format!("focus_importance_sum_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    b.arg(&mut out).arg(&partial).arg(&l_v).arg(&mm).arg(&h);
    // SAFETY: argument list matches `focus_importance_sum_*` in focus.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(wrap(out, dev, (rows, m)))
}
