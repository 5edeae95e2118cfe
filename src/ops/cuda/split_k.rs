//! Projections split over k (`ops::split_k`): cuBLAS's strided-batched GEMM writes one f32
//! partial product per k slice, and the row norm that consumes the projection sums them
//! (`add_rms_norm_parts_*` / `add_rms_norm_pre_parts_*` in fused.cu).

use super::fused::row_norm_config;
use super::launch::{check_given, device, for_float, kernel, pair_given, pair_guards, same_device_dtype, view, Dest, Module};
use crate::ops::into::NormAfter;
use candle_core::cuda_backend::cudarc::cublas::{result::gemm_strided_batched_ex, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// `x · wᵀ` (`x` `[rows, k]`, `w` `[n, k]`, one float dtype) as `splits` products over
/// consecutive k slices: f32 `[splits, rows, n]`, slice `i` = `x[:, i·k/s..] · w[:, i·k/s..]ᵀ`
/// with f32 accumulation. `k` must divide by `splits`.
pub fn linear_partials(x: &Tensor, w: &Tensor, splits: usize) -> Result<Tensor> {
    sliced_gemm(x, w, splits, DType::F32, None)
}

/// [`linear_partials`] written into `out` (f32 `[splits, rows, n]`, contiguous).
pub fn linear_partials_into(x: &Tensor, w: &Tensor, splits: usize, out: &Tensor) -> Result<()> {
    sliced_gemm(x, w, splits, DType::F32, Some(out)).map(|_| ())
}

/// `x · wᵀ` in `x`'s dtype (f32 accumulation) written into `out` (`[rows, n]`, contiguous): the
/// cuBLAS call candle's matmul of `x` and `wᵀ` makes, with the output pointer ours.
pub fn linear_into(x: &Tensor, w: &Tensor, out: &Tensor) -> Result<()> {
    sliced_gemm(x, w, 1, x.dtype(), Some(out)).map(|_| ())
}

/// `splits` products over consecutive k slices, stored as `out_dtype` (f32, or `x`'s dtype for
/// one slice) `[splits, rows, n]` (`[rows, n]` with `given` of that shape).
fn sliced_gemm(x: &Tensor, w: &Tensor, splits: usize, out_dtype: DType, given: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "linear_partials";
    let dev = device(x, OP)?;
    let dtype = x.dtype();
    same_device_dtype(OP, dtype, x, &[("w", w)])?;
    let (rows, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if kw != k {
        bail!("{OP} (cuda): x {:?} against w {:?}", x.dims(), w.dims());
    }
    if splits == 0 || k % splits != 0 {
        bail!("{OP} (cuda): {k} columns do not split into {splits} slices");
    }
    if out_dtype != DType::F32 && (out_dtype != dtype || splits != 1) {
        bail!("{OP} (cuda): a {out_dtype:?} output of a {dtype:?} product in {splits} slices");
    }
    if let Some(t) = given {
        same_device_dtype(OP, out_dtype, x, &[("out", t)])?;
        if t.elem_count() != splits * rows * n || t.dims().last() != Some(&n) {
            bail!("{OP} (cuda): out {:?} for {splits} slices of [{rows}, {n}]", t.dims());
        }
    }
    if rows == 0 || n == 0 || k == 0 {
        return match given {
            Some(t) if k == 0 && rows * n > 0 => {
                t.slice_set(&t.zeros_like()?, 0, 0)?;
                Ok(t.clone())
            }
            Some(t) => Ok(t.clone()),
            None => Tensor::zeros((splits, rows, n), DType::F32, x.device()),
        };
    }
    let fits = |v: usize| v <= i32::MAX as usize;
    let elems = splits.checked_mul(rows).and_then(|v| v.checked_mul(n));
    if !(fits(rows) && fits(n) && fits(k) && fits(splits) && elems.is_some_and(|e| e < isize::MAX as usize / 4)) {
        bail!("{OP} (cuda): sizes out of range");
    }
    let cuda_type = |d: DType| match d {
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType_t::CUDA_R_16F),
        DType::F32 => Ok(sys::cudaDataType_t::CUDA_R_32F),
        d => bail!("{OP} (cuda): dtype {d:?} not supported"),
    };
    let types = (cuda_type(dtype)?, cuda_type(out_dtype)?);
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let shape = (rows, n, k);
    match out_dtype {
        DType::F32 => for_float!(dtype, OP, |T, _suf| sliced_gemm_launch::<T, f32>(&dev, &x, &w, types, shape, splits, given)),
        _ => for_float!(dtype, OP, |T, _suf| sliced_gemm_launch::<T, T>(&dev, &x, &w, types, shape, splits, given)),
    }
}

fn sliced_gemm_launch<T: CudaDType + DeviceRepr, O: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    (data_type, out_type): (sys::cudaDataType_t, sys::cudaDataType_t),
    (rows, n, k): (usize, usize, usize),
    splits: usize,
    given: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "linear_partials";
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let x_v = view::<T>(&xs, xl, OP, "x", false)?;
    let w_v = view::<T>(&ws, wl, OP, "w", false)?;
    let given_sl = given.map(|t| t.storage_and_layout());
    // SAFETY: beta = 0, so cuBLAS writes every element of every slice.
    let out = unsafe { Dest::<O>::new(dev, splits * rows * n, given_sl.as_ref().map(|(s, l)| (&**s, *l)), OP, "out")? };
    let kc = k / splits;
    let (alpha, beta) = (1f32, 0f32);
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    {
        let (w_ptr, _w_guard) = w_v.device_ptr(&stream);
        let (x_ptr, _x_guard) = x_v.device_ptr(&stream);
        let (o_ptr, _o_guard) = match &out {
            Dest::Fresh(s) => s.device_ptr(&stream),
            Dest::Given(v) => v.device_ptr(&stream),
        };
        // Column-major view of the row-major product: out_iᵀ [n, rows] = W_i [n, kc] · X_iᵀ
        // [kc, rows], where W_i and X_i start kc columns apart inside w and x (leading dim k).
        // SAFETY: pointers are live for the call (guards), every slice lies inside its buffer
        // (i·kc + kc <= k per row), alpha/beta are f32 as CUBLAS_COMPUTE_32F requires.
        unsafe {
            gemm_strided_batched_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                rows as i32,
                kc as i32,
                (&alpha) as *const f32 as *const _,
                w_ptr as *const _,
                data_type,
                k as i32,
                kc as i64,
                x_ptr as *const _,
                data_type,
                k as i32,
                kc as i64,
                (&beta) as *const f32 as *const _,
                o_ptr as *mut _,
                out_type,
                n as i32,
                (rows * n) as i64,
                splits as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .w()?;
    }
    Ok(out.finish(dev, (splits, rows, n), given))
}

/// The row norm `norm` with `x` = the sum of `parts` (f32 `[splits, rows, C]`, summed in slice
/// order, rounded to the residual's dtype) and `residual` `[rows, C]`; one launch. Returns `(h, n)`.
pub fn norm_of_partials(residual: &Tensor, parts: &Tensor, norm: NormAfter, eps: f32) -> Result<(Tensor, Tensor)> {
    norm_of_partials_to(residual, parts, norm, eps, None)
}

/// [`norm_of_partials`] writing `(h, n)` into `outs` (the residual's shape and dtype,
/// contiguous, aliasing no input).
pub fn norm_of_partials_into(residual: &Tensor, parts: &Tensor, norm: NormAfter, eps: f32, h: &Tensor, n: &Tensor) -> Result<()> {
    norm_of_partials_to(residual, parts, norm, eps, Some((h, n))).map(|_| ())
}

fn norm_of_partials_to(residual: &Tensor, parts: &Tensor, norm: NormAfter, eps: f32, outs: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "norm_of_partials";
    let dev = device(residual, OP)?;
    let dtype = residual.dtype();
    let (kernel_name, weights): (&str, Vec<(&str, &Tensor)>) = match norm {
        NormAfter::Sandwich { w_x, w_next } => ("add_rms_norm_parts", vec![("w_x", w_x), ("w_next", w_next)]),
        NormAfter::PreNorm { w } => ("add_rms_norm_pre_parts", vec![("w", w)]),
        NormAfter::PostNorm { w, w_next } => ("post_norm_parts", vec![("w", w), ("w_next", w_next)]),
    };
    same_device_dtype(OP, dtype, residual, &weights)?;
    same_device_dtype(OP, DType::F32, residual, &[("parts", parts)])?;
    let (splits, rows, ncols) = parts.dims3()?;
    if residual.dims() != [rows, ncols] {
        bail!("{OP} (cuda): residual {:?} against parts {:?}", residual.dims(), parts.dims());
    }
    for (name, w) in &weights {
        if w.dims1()? != ncols {
            bail!("{OP} (cuda): {name} {:?} for {ncols} columns", w.dims());
        }
    }
    check_given(OP, "h", residual, dtype, residual.dims(), outs.map(|o| o.0))?;
    check_given(OP, "n", residual, dtype, residual.dims(), outs.map(|o| o.1))?;
    if splits == 0 || ncols > i32::MAX as usize || splits > i32::MAX as usize || rows > u32::MAX as usize / 2 {
        bail!("{OP} (cuda): sizes out of range");
    }
    if rows == 0 || ncols == 0 {
        return Ok((residual.clone(), residual.zeros_like()?));
    }
    let residual = residual.contiguous()?;
    let parts = parts.contiguous()?;
    let weights: Vec<Tensor> = weights.iter().map(|(_, w)| w.contiguous()).collect::<Result<_>>()?;
    for_float!(dtype, OP, |T, suf| parts_norm_launch::<T>(&dev, &format!("{kernel_name}_{suf}"), &residual, &parts, &weights, (splits, rows, ncols), eps, outs))
}

/// Launches `kernel` (`add_rms_norm_parts_*` and `post_norm_parts_*` with two weights,
/// `add_rms_norm_pre_parts_*` with one).
#[allow(clippy::too_many_arguments)]
fn parts_norm_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    kernel: &str,
    residual: &Tensor,
    parts: &Tensor,
    weights: &[Tensor],
    (splits, rows, ncols): (usize, usize, usize),
    eps: f32,
    outs: Option<(&Tensor, &Tensor)>,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "norm_of_partials";
    let (rs, rl) = residual.storage_and_layout();
    let (ps, pl) = parts.storage_and_layout();
    let r_v = view::<T>(&rs, rl, OP, "residual", false)?;
    let p_v = view::<f32>(&ps, pl, OP, "parts", false)?;
    let w_s: Vec<_> = weights.iter().map(|w| w.storage_and_layout()).collect();
    let w_v = w_s.iter().map(|(s, l)| view::<T>(s, l, OP, "weight", false)).collect::<Result<Vec<_>>>()?;
    let guards = pair_guards(outs);
    let [h_given, n_given] = pair_given(&guards);
    // SAFETY: the kernel writes every element of both outputs (one block per row).
    let mut h_out = unsafe { Dest::<T>::new(dev, rows * ncols, h_given, OP, "h")? };
    let mut n_out = unsafe { Dest::<T>::new(dev, rows * ncols, n_given, OP, "n")? };
    let (stride, nparts, nc) = ((rows * ncols) as i64, splits as i32, ncols as i32);
    let func = kernel!(dev, Module::Fused, kernel)?;
    let mut b = func.builder();
    h_out.push(&mut b);
    n_out.push(&mut b);
    b.arg(&r_v).arg(&p_v).arg(&stride).arg(&nparts);
    for w in &w_v {
        b.arg(w);
    }
    b.arg(&nc).arg(&eps);
    // SAFETY: argument list matches `add_rms_norm_parts_*` and `post_norm_parts_*` (two
    // weights) or `add_rms_norm_pre_parts_*` (one) in fused.cu.
    unsafe { b.launch(row_norm_config(rows, ncols)) }.w()?;
    drop(b);
    Ok((h_out.finish(dev, (rows, ncols), outs.map(|o| o.0)), n_out.finish(dev, (rows, ncols), outs.map(|o| o.1))))
}
