//! Dream-v0 (HKUNLP/Dream): Qwen2.5 weights — q/k/v biases, no q/k norm — with bidirectional
//! attention; logits are shifted by one (the runner applies the shift, not the model).

use super::transformer::qwen_named_arch;
use super::{DenseArch, DenseDiffusion, DiffusionAttention, Naming};
use crate::diffusion::models::DreamConfig;
use crate::diffusion::{DiffusionSampler, FilterOrder};
use crate::loader::Weights;

/// Dream's constructors.
#[derive(Debug, Clone, Copy)]
pub struct Dream;

impl Dream {
    pub fn arch(cfg: &DreamConfig) -> DenseArch {
        // The context is the config's window: Dream's README caps input + output at 2048, a cap
        // left to the engine's `max_model_len`.
        qwen_named_arch!(cfg, {
            naming: Naming::QWEN,
            model_type: "Dream".into(),
            rotary_dim: cfg.head_dim(),
            qk_norm: false,
            qkv_bias: true,
            attention: DiffusionAttention::Bidirectional,
            shift_logits: true,
            block_length: None,
            moe: None,
            unmask_threshold: None,
            sampler: DiffusionSampler::Filtered(FilterOrder::TopPThenTopK),
        })
    }

    pub fn load(cfg: &DreamConfig, w: &Weights) -> crate::Result<DenseDiffusion> {
        cfg.validate("DreamConfig")?;
        DenseDiffusion::load(&Self::arch(cfg), w)
    }
}
