//! LLaDA2.0 (inclusionAI/LLaDA2.0-mini, -flash; `llada2_moe`): Ling-2.0's MoE transformer
//! trained for block diffusion — fused QKV, per-head q/k RMSNorm, RoPE on the first half of each
//! head, a dense first layer then MoE layers (sigmoid router with a selection-only expert bias,
//! group-limited top-k, weights renormalised × `routed_scaling_factor`, one shared expert),
//! block-causal attention with blocks from position 0, no logit shift, untied head.

use super::moe::{RouterArch, Scoring};
use super::transformer::qwen_named_arch;
use super::{DenseArch, DenseDiffusion, DiffusionAttention, MoeArch, Naming};
use crate::diffusion::models::Llada2Config;
use crate::diffusion::{DiffusionSampler, FilterOrder};
use crate::loader::Weights;

/// LLaDA2.0's constructors.
#[derive(Debug, Clone, Copy)]
pub struct Llada2;

impl Llada2 {
    /// The MoE layers' router: sigmoid scores, groups (one group: no limit, whatever
    /// `topk_group` says), renormalised × `routed_scaling_factor`.
    pub fn router(cfg: &Llada2Config) -> RouterArch {
        RouterArch {
            num_experts: cfg.num_experts,
            top_k: cfg.num_experts_per_tok,
            n_group: cfg.n_group,
            topk_group: if cfg.n_group == 1 { 1 } else { cfg.topk_group },
            scoring: Scoring::Sigmoid,
            norm_topk: cfg.norm_topk_prob,
            scale: cfg.routed_scaling_factor,
        }
    }

    pub fn arch(cfg: &Llada2Config) -> DenseArch {
        let router = Self::router(cfg);
        qwen_named_arch!(cfg, {
            naming: Naming::LLADA2,
            model_type: "llada2_moe".into(),
            rotary_dim: cfg.rotary_dim(),
            qk_norm: cfg.use_qk_norm,
            qkv_bias: false,
            attention: DiffusionAttention::BlockCausal,
            shift_logits: false,
            block_length: Some(cfg.block_size.unwrap_or(Llada2Config::DEFAULT_BLOCK)),
            // The released generate's and the tech report's setting.
            unmask_threshold: Some(0.95),
            sampler: DiffusionSampler::Filtered(FilterOrder::TopKThenTopP),
            // A config whose layers are all dense (`first_k_dense_replace` covers them) has no
            // router to check or build, as its validation already allows.
            moe: (cfg.num_hidden_layers > cfg.first_k_dense_replace).then(|| MoeArch {
                router,
                moe_layers: (0..cfg.num_hidden_layers).map(|l| l >= cfg.first_k_dense_replace).collect(),
                expert_width: cfg.moe_intermediate_size,
                shared_experts: cfg.num_shared_experts,
                expert_bias: cfg.moe_router_enable_expert_bias,
            }),
        })
    }

    pub fn load(cfg: &Llada2Config, w: &Weights) -> crate::Result<DenseDiffusion> {
        cfg.validate("Llada2Config")?;
        DenseDiffusion::load(&Self::arch(cfg), w)
    }
}
