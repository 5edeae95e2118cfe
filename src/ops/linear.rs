//! Linear layers (`x · W^T`, no bias) as an op. At decode widths a layer streams its weights
//! for a few rows, where cuBLAS's skinny GEMMs reach about half of the copy bandwidth; on CUDA
//! bf16 / f16 inputs of at most 64 rows run our skinny kernel (`kernels/linear.cu`) instead.
//! Elsewhere — and as its reference — candle's `Linear`.

use candle_core::{Module, Result, Tensor};
use candle_nn::Linear;

/// `layer(x)` for `x` `[rows, in]`.
pub fn linear(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if skinny_serves(x, layer) {
        return super::cuda::linear_skinny(x, layer.weight());
    }
    layer.forward(x)
}

/// Whether the skinny kernel runs `layer` on `x`.
#[cfg(feature = "cuda")]
fn skinny_serves(x: &Tensor, layer: &Linear) -> bool {
    let w = layer.weight();
    x.device().is_cuda()
        && layer.bias().is_none()
        && matches!(x.dtype(), candle_core::DType::BF16 | candle_core::DType::F16)
        && w.dtype() == x.dtype()
        && w.is_contiguous()
        && x.rank() == 2
        && (1..=super::cuda::SKINNY_MAX_ROWS).contains(&x.dims()[0])
        && w.dims2().is_ok_and(|(n, k)| n % 8 == 0 && k % 8 == 0 && k == x.dims()[1])
}
