//! SDAR (JetAstra/SDAR, JetLM/SDAR-*-Chat): Qwen3 weights trained for block diffusion —
//! per-head q/k RMSNorm, no biases, block-causal attention, no logit shift. The MoE checkpoints
//! (`sdar_moe`, e.g. SDAR-30B-A3B) have Qwen3-MoE layers: a softmax router over the experts,
//! top-k, optionally renormalised, no shared expert.

use super::moe::{RouterArch, Scoring};
use super::transformer::qwen_named_arch;
use super::{DenseArch, DenseDiffusion, DiffusionAttention, MoeArch, Naming};
use crate::diffusion::models::SdarConfig;
use crate::diffusion::{DiffusionSampler, FilterOrder};
use crate::loader::Weights;

/// SDAR's constructors.
#[derive(Debug, Clone, Copy)]
pub struct Sdar;

impl Sdar {
    /// The Qwen3-MoE router of the `sdar_moe` checkpoints.
    pub fn router(cfg: &SdarConfig) -> RouterArch {
        RouterArch {
            num_experts: cfg.num_experts.unwrap_or(0),
            top_k: cfg.num_experts_per_tok.unwrap_or(0),
            n_group: 1,
            topk_group: 1,
            scoring: Scoring::Softmax,
            norm_topk: cfg.norm_topk_prob,
            scale: 1.0,
        }
    }

    pub fn arch(cfg: &SdarConfig) -> DenseArch {
        qwen_named_arch!(cfg, {
            naming: Naming::QWEN,
            model_type: cfg.model_type.clone(),
            rotary_dim: cfg.head_dim(),
            qk_norm: true,
            qkv_bias: false,
            attention: DiffusionAttention::BlockCausal,
            shift_logits: false,
            block_length: cfg.block_size,
            // Qwen3-MoE: softmax router, no groups, no bias, no shared expert.
            moe: cfg.moe_layers().contains(&true).then(|| MoeArch {
                router: Self::router(cfg),
                moe_layers: cfg.moe_layers(),
                expert_width: cfg.moe_intermediate_size.unwrap_or(0),
                shared_experts: 0,
                expert_bias: false,
            }),
            unmask_threshold: None,
            sampler: DiffusionSampler::Filtered(FilterOrder::TopKThenTopP),
        })
    }

    pub fn load(cfg: &SdarConfig, w: &Weights) -> crate::Result<DenseDiffusion> {
        cfg.validate("SdarConfig")?;
        DenseDiffusion::load(&Self::arch(cfg), w)
    }
}
