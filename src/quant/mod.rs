//! Weight quantization: which of a model's weights are stored in 8 bits, and how they are
//! stored ([`fp8`]). A model's linear layers hold their weight dense or in FP8 behind one type,
//! which every op that multiplies by a weight goes through, so a quantized model runs the same
//! code.

pub mod checkpoint;
pub mod fp8;

pub use checkpoint::CheckpointQuant;
pub use fp8::{Fp8Scale, Fp8Weight, E4M3_MAX};

/// How an engine stores its linear layers' weights.
///
/// [`Quantization::Fp8`] quantizes at load, from the checkpoint's own precision, the layers
/// whose bytes dominate a step: attention projections and MLPs (dense, routed experts and
/// shared experts). Embeddings, norms, routers, exit gates and the LM head stay in the engine's
/// dtype: they are a small share of the bytes, and the head's and the gates' outputs decide
/// tokens and exits directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Quantization {
    /// Weights in the engine's dtype.
    #[default]
    None,
    /// E4M3 with one f32 scale per output channel (the row's largest magnitude ÷ 448).
    Fp8,
}

impl std::str::FromStr for Quantization {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "none" | "bf16" => Ok(Self::None),
            "fp8" => Ok(Self::Fp8),
            other => Err(crate::Error::InvalidOption(format!("unknown quantization `{other}` (none, fp8)"))),
        }
    }
}
