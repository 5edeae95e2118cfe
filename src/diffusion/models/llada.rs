//! LLaDA-8B (ML-GSAI/LLaDA): Llama blocks under OLMo tensor names, no biases, no q/k norm,
//! bidirectional attention, no logit shift, an untied output matrix by default.

use super::{DenseArch, DenseDiffusion, DiffusionAttention, Naming};
use crate::diffusion::models::LladaConfig;
use crate::diffusion::DiffusionSampler;
use crate::loader::Weights;

/// LLaDA's constructors.
#[derive(Debug, Clone, Copy)]
pub struct Llada;

impl Llada {
    pub fn arch(cfg: &LladaConfig) -> DenseArch {
        DenseArch {
            naming: Naming::LLADA,
            model_type: "llada".into(),
            vocab_size: cfg.vocab_size,
            table_rows: cfg.table_rows(),
            hidden_size: cfg.d_model,
            intermediate_size: cfg.mlp_hidden_size,
            num_layers: cfg.n_layers,
            num_heads: cfg.n_heads,
            num_kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            rotary_dim: cfg.head_dim(),
            rope_theta: cfg.rope_theta,
            rms_norm_eps: cfg.rms_norm_eps,
            qk_norm: false,
            qkv_bias: false,
            tie_embeddings: cfg.weight_tying,
            attention: DiffusionAttention::Bidirectional,
            shift_logits: false,
            mask_token_id: cfg.mask_token_id(),
            block_length: None,
            moe: None,
            unmask_threshold: None,
            sampler: DiffusionSampler::Gumbel,
            max_context: cfg.max_sequence_length,
        }
    }

    pub fn load(cfg: &LladaConfig, w: &Weights) -> crate::Result<DenseDiffusion> {
        cfg.validate("LladaConfig")?;
        DenseDiffusion::load(&Self::arch(cfg), w)
    }
}
