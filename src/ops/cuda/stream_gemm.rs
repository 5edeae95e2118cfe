//! The weight-streaming decode GEMM (`kernels/stream_gemm.cu`, `KernelPolicy::stream_gemm`): the
//! dense 16-bit products of up to 64 rows that `split_k`'s `sliced_gemm` otherwise hands cuBLAS,
//! with the same outputs (a rounded product, or f32 partials over equal slices of k).

use super::launch::{kernel, Dest, Module};
use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, DType, Layout, Result, WithDType};

use crate::ops::split_k::STREAM_GEMM_SMEM_BYTES;

/// Most rows a launch takes (four m16 tiles).
const STREAM_GEMM_MAX_ROWS: usize = 64;

/// Whether the kernel takes a product of `rows` rows of `dtype` over k (x and w laid out as
/// `x_layout`, `w_layout`, contiguous) in slices of `slice`: bf16 / f16, 1 ..= 64 rows, k and the
/// slice multiples of 8 and both operands 16-byte aligned (its 16-byte loads), the sizes in range.
pub(super) fn serves(dtype: DType, rows: usize, (n, k, slice): (usize, usize, usize), x_layout: &Layout, w_layout: &Layout) -> bool {
    let aligned = |l: &Layout| (l.start_offset() * dtype.size_in_bytes()) % 16 == 0;
    matches!(dtype, DType::BF16 | DType::F16)
        && (1..=STREAM_GEMM_MAX_ROWS).contains(&rows)
        && k % 8 == 0
        && slice > 0
        && slice % 8 == 0
        && k % slice == 0
        && n.div_ceil(16) <= i32::MAX as usize
        // The kernel rounds k up to whole 64-wide chunks in an int; slices are the grid's y.
        && k <= i32::MAX as usize - 64
        && k / slice <= 65535
        && aligned(x_layout)
        && aligned(w_layout)
}

/// `out` = `x · wᵀ` (`x` `[rows, k]`, `w` `[n, k]`), in `k / slice` partial products over
/// consecutive slices of k as f32 (`O` f32, `out` `[k / slice, rows, n]`) or whole, rounded to
/// `T` (`O` = `T`, one slice, `out` `[rows, n]`). The caller checked the shape with [`serves`].
#[allow(clippy::too_many_arguments)]
pub(super) fn launch<T: CudaDType + DeviceRepr, O: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    suf: &str,
    x: &CudaView<T>,
    w: &CudaView<T>,
    out: &mut Dest<O>,
    (rows, n, k): (usize, usize, usize),
    slice: usize,
) -> Result<()> {
    let tiles = rows.div_ceil(16).next_power_of_two();
    let func = kernel!(dev, Module::StreamGemm, &format!("stream_gemm_m{tiles}_{suf}"))?;
    let splits = k / slice;
    let cfg = LaunchConfig { grid_dim: (n.div_ceil(16) as u32, splits as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: STREAM_GEMM_SMEM_BYTES };
    let f32_out = i32::from(O::DTYPE == DType::F32);
    let (r, nn, kk, sl) = (rows as i32, n as i32, k as i32, slice as i32);
    let mut b = func.builder();
    out.push(&mut b);
    b.arg(x).arg(w).arg(&r).arg(&nn).arg(&kk).arg(&sl).arg(&f32_out);
    // SAFETY: argument list matches `stream_gemm_m*_*` in stream_gemm.cu; `serves` checked the
    // alignment and sizes, every output element of the grid's columns and slices is written.
    unsafe { b.launch(cfg) }.w()?;
    crate::ops::policy::count(|c| c.stream_gemm += 1);
    Ok(())
}
