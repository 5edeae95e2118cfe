//! Tensor operations the models are built from. Each op has one entry point that dispatches on
//! the device: a CPU implementation written with candle ops (also the reference the CUDA kernels
//! are tested against) and, with the `cuda` feature, a kernel of our own.

mod batch;
mod paged_attention;
mod rope;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use batch::{AttnMask, PagedBatch, PagedBatchHost};
pub use paged_attention::{paged_attention, paged_attention_reference, write_kv};
pub use rope::{RopeAngles, RopeTable};

use candle_core::{DType, Result, Tensor};

/// RMSNorm with the statistics in f32 whatever the input dtype (Ouro and Huginn both do the
/// norm math in f32). candle's fused kernel accumulates in f32 on every backend.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    candle_nn::ops::rms_norm(x, weight, eps as f32)
}

/// `silu(gate) * up`, where `gate_up` holds the two halves side by side on the last dim.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    let n = gate_up.dim(candle_core::D::Minus1)? / 2;
    let gate = gate_up.narrow(candle_core::D::Minus1, 0, n)?;
    let up = gate_up.narrow(candle_core::D::Minus1, n, n)?;
    candle_nn::ops::silu(&gate)? * up
}

/// Whether a dtype is one the models run in.
pub fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}
