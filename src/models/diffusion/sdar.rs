//! SDAR (JetAstra/SDAR, JetLM/SDAR-*-Chat): Qwen3 weights trained for block diffusion —
//! per-head q/k RMSNorm, no biases, block-causal attention, no logit shift.

use super::{DenseArch, DenseDiffusion, DiffusionAttention, Naming};
use crate::loader::Weights;
use crate::models::SdarConfig;

/// SDAR's constructors.
#[derive(Debug, Clone, Copy)]
pub struct Sdar;

impl Sdar {
    pub fn arch(cfg: &SdarConfig) -> DenseArch {
        DenseArch {
            naming: Naming::QWEN,
            model_type: "sdar".into(),
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
            qk_norm: true,
            qkv_bias: false,
            tie_embeddings: cfg.tie_word_embeddings,
            attention: DiffusionAttention::BlockCausal,
            shift_logits: false,
            mask_token_id: cfg.mask_token_id(),
            block_length: cfg.block_size,
            moe: None,
            max_context: cfg.max_position_embeddings,
        }
    }

    pub fn load(cfg: &SdarConfig, w: &Weights) -> crate::Result<DenseDiffusion> {
        cfg.validate("SdarConfig")?;
        DenseDiffusion::load(&Self::arch(cfg), w)
    }
}
