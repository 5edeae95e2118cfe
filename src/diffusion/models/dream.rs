//! Dream-v0 (HKUNLP/Dream): Qwen2.5 weights — q/k/v biases, no q/k norm — with bidirectional
//! attention; logits are shifted by one (the runner applies the shift, not the model).

use super::{DenseArch, DenseDiffusion, DiffusionAttention, Naming};
use crate::diffusion::models::DreamConfig;
use crate::loader::Weights;

/// Dream's constructors.
#[derive(Debug, Clone, Copy)]
pub struct Dream;

impl Dream {
    pub fn arch(cfg: &DreamConfig) -> DenseArch {
        DenseArch {
            naming: Naming::QWEN,
            model_type: "Dream".into(),
            vocab_size: cfg.vocab_size,
            table_rows: cfg.vocab_size,
            hidden_size: cfg.hidden_size,
            intermediate_size: cfg.intermediate_size,
            num_layers: cfg.num_hidden_layers,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            rotary_dim: cfg.head_dim(),
            rope_theta: cfg.rope_theta,
            rms_norm_eps: cfg.rms_norm_eps,
            qk_norm: false,
            qkv_bias: true,
            tie_embeddings: cfg.tie_word_embeddings,
            attention: DiffusionAttention::Bidirectional,
            shift_logits: true,
            mask_token_id: cfg.mask_token_id(),
            block_length: None,
            // Dream's README caps input + output at 2048; the config's window is kept here
            // and the cap left to the engine's `max_model_len`.
            moe: None,
            unmask_threshold: None,
            max_context: cfg.max_position_embeddings,
        }
    }

    pub fn load(cfg: &DreamConfig, w: &Weights) -> crate::Result<DenseDiffusion> {
        cfg.validate("DreamConfig")?;
        DenseDiffusion::load(&Self::arch(cfg), w)
    }
}
