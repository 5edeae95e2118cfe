//! Tensor operations the models are built from. Each op has one entry point that dispatches on
//! the device: a CPU implementation written with candle ops (also the reference the CUDA kernels
//! are tested against) and, with the `cuda` feature, a kernel of our own.

// The references and kernel selectors are for the device tests (feature `testing`).
#![cfg_attr(not(feature = "testing"), allow(unused_imports))]

#[cfg(any(test, feature = "cuda"))]
pub(crate) mod attention_split;

/// Most key splits the SIMT paged-attention kernel cuts a (row, kv head) tile into; each costs a
/// partial of `[T, H, D]` f32, and a decode arena's workspace holds this many for its widest
/// launch.
pub(crate) const MAX_ATTENTION_SPLITS: usize = 32;
mod batch;
mod compact;
mod focus_importance;
pub mod fused;
pub mod into;
mod linear;
pub mod moe;
mod non_finite;
mod paged_attention;
pub mod policy;
mod rope;
mod scatter;
pub mod split_k;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use batch::{write_u32, AttnMask, PagedBatch, PagedBatchBuffers, PagedBatchHost};
pub use compact::{compact_rows, compact_rows_reference};
#[cfg(any(test, feature = "testing"))]
pub use focus_importance::importance_oracle;
pub use focus_importance::{importance, importance_of};
pub use fused::{
    add_rms_norm, qkv_bias_rope_i_write, qkv_norm_rope, qkv_norm_rope_write, qkv_rope_attention, qkv_rope_write, residual_add, residual_add_rms_norm, silu_mul,
};
pub use linear::{bytes_of, fp8_matmul, w8a8_reference, Linear, LinearWeight};
pub(crate) use non_finite::greedy_ids;
pub use non_finite::{flag_non_finite, greedy_ids_flagged, greedy_ids_flagged_reference, is_non_finite_flag, non_finite_rows};
pub use paged_attention::{paged_attention, paged_attention_reference, write_kv, write_kv_reference};
pub use policy::{with_kernels, AttentionKernels, Fp8Kernels, KernelCounts, KernelPolicy};
pub use rope::{RopeAngles, RopeTable};
pub use scatter::{copy_rows, copy_rows_reference, scatter_rows, scatter_rows_reference};
pub use split_k::{linear_add_rms_norm, linear_f32, linear_residual_add_rms_norm};

use candle_core::{DType, Result, Tensor};

/// RMSNorm over the last dim with the statistics in f32 whatever the input dtype (every model
/// family does the norm math in f32): on CUDA our 16-byte-vector kernel (`fused.cu`), elsewhere
/// candle's fused op, which is also [`rms_norm_reference`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && is_float(x.dtype()) && weight.dtype() == x.dtype() {
        return Ok(cuda::rms_norm(None, x, weight, eps as f32)?.1);
    }
    rms_norm_reference(x, weight, eps)
}

/// candle's RMSNorm: the op behind [`rms_norm`] off CUDA and the reference of its kernel.
pub fn rms_norm_reference(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    candle_nn::ops::rms_norm(x, weight, eps as f32)
}

/// Whether a dtype is one the models run in.
pub fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}
