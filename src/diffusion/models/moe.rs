//! Mixture-of-experts MLP layers: a router picks `top_k` experts per token, their SwiGLU outputs
//! are summed with the router's weights (in f32), and shared experts are added with weight 1.
//!
//! Two router layouts ([`RouterArch`]): LLaDA2.0's (Ling-2.0: sigmoid scores, an expert bias that
//! only *selects*, group-limited choice, renormalised weights × a scaling factor) and
//! Qwen3-MoE's (softmax scores, no groups, no bias). Routing and the experts are ops
//! ([`crate::ops::moe`]): kernels on CUDA, the candle composition elsewhere.

use crate::ops;
pub use crate::ops::moe::{RouterArch, Scoring};
use crate::ops::moe::{RouterWeights, StackedExperts};
use crate::ops::Linear;
use candle_core::{Result, Tensor};

/// One SwiGLU MLP (a dense layer's, or the shared experts'): gate and up stacked on the output
/// dim (the layout [`ops::silu_mul`] takes), then down.
#[derive(Debug, Clone)]
pub(crate) struct Expert {
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
}

impl Expert {
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.down.forward(&ops::silu_mul(&self.gate_up.forward(x)?)?)
    }
}

/// A loaded MoE layer.
#[derive(Debug, Clone)]
pub(crate) struct Moe {
    pub(crate) arch: RouterArch,
    pub(crate) router: RouterWeights,
    /// Selection bias `[experts]` f32 (LLaDA2.0's `expert_bias`).
    pub(crate) bias: Option<Tensor>,
    pub(crate) experts: StackedExperts,
    pub(crate) shared: Option<Expert>,
    /// Expert parallelism: this rank holds the model's experts `first..first + n`.
    pub(crate) first_expert: Option<u32>,
}

impl Moe {
    /// Chosen experts `[tokens, top_k]` u32 and weights `[tokens, top_k]` f32 of `x`
    /// `[tokens, hidden]`.
    fn route(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        ops::moe::route(&self.router.logits(x)?, self.bias.as_ref(), &self.arch)
    }

    /// Chosen experts of each token of `x`, best first.
    pub(crate) fn routes(&self, x: &Tensor) -> Result<Vec<Vec<u32>>> {
        self.route(x)?.0.to_vec2()
    }

    /// `residual + ` the layer's output for `x` (the residual add fused into the combine). On a
    /// rank of a tensor-parallel group the router runs whole (every rank routes alike); the
    /// rank's part — its experts (expert parallelism) or its columns of every expert, and its
    /// columns of the shared experts — is summed over the ranks, then added.
    pub(crate) fn forward_residual(&self, residual: &Tensor, x: &Tensor, tp: Option<&crate::parallel::TpShard>) -> Result<Tensor> {
        let (ids, weights) = self.route(x)?;
        let shared = self.shared.as_ref().map(|s| s.forward(x)).transpose()?;
        let Some(tp) = tp else {
            return ops::moe::moe_experts(x, &ids, &weights, &self.experts, shared.as_ref(), Some(residual));
        };
        let part = match self.first_expert {
            Some(first) => ops::moe::moe_experts_local(x, &ids, &weights, &self.experts, first, shared.as_ref(), None)?,
            None => ops::moe::moe_experts(x, &ids, &weights, &self.experts, shared.as_ref(), None)?,
        };
        ops::residual_add(residual, &tp.sum(&part)?)
    }
}
