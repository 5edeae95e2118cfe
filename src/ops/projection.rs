//! A bias-free linear projection `y = x · wᵀ` (a looped model's QKV, output, MLP and head
//! weights). On CUDA its decode-width GEMMs take the tuned cuBLASLt path
//! (`cuda::tuned_linear`); every other case is candle's `Linear`.

use candle_core::{Module, Result, Tensor};

/// `y = x · wᵀ` for a weight `[out, in]`.
#[derive(Debug, Clone)]
pub struct Projection {
    linear: candle_nn::Linear,
}

impl Projection {
    pub fn new(weight: Tensor) -> Self {
        Self { linear: candle_nn::Linear::new(weight, None) }
    }

    /// The weight `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        self.linear.weight()
    }
}

impl Module for Projection {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            if let Some(y) = super::cuda::tuned_linear(x, self.linear.weight())? {
                return Ok(y);
            }
        }
        self.linear.forward(x)
    }
}
