//! Masked-diffusion LMs (SDAR, LLaDA, Dream) as a stack of layers that a diffusion runner drives
//! one layer at a time. Each layer is split into `project` (norm, QKV, q/k norm, RoPE) and
//! `finish_layer` (paged attention, output projection, MLP), so the runner can write K/V, score
//! tokens from post-RoPE q/k and drop tokens between the two halves (FOCUS).

mod config;
mod dream;
mod llada;
mod llada2;
mod moe;
mod sdar;
mod transformer;

pub use config::{DreamConfig, Llada2Config, LladaConfig, SdarConfig};
#[cfg(feature = "testing")]
pub use moe::{RouterArch, Scoring};
pub use transformer::DenseDiffusion;
pub(crate) use transformer::{DenseArch, MoeArch, Naming};
/// Each family's loader from its own config (public with feature `testing`; an application
/// loads any of them with [`load`]).
#[cfg(feature = "testing")]
pub use {dream::Dream, llada::Llada, llada2::Llada2, sdar::Sdar};
#[cfg(not(feature = "testing"))]
pub(crate) use {dream::Dream, llada::Llada, llada2::Llada2, sdar::Sdar};

use crate::config::ModelConfig;
use crate::kv::KvStore;
use crate::loader::Weights;
use crate::ops::{PagedBatch, RopeAngles};
use candle_core::{DType, Device, Result, Tensor};

/// Loads the diffusion model `config` describes; a looped family is `Error::UnsupportedModel`.
pub fn load(config: &ModelConfig, w: &Weights) -> crate::Result<DenseDiffusion> {
    match config {
        ModelConfig::Sdar(c) => Sdar::load(c, w),
        ModelConfig::Llada(c) => Llada::load(c, w),
        ModelConfig::Llada2(c) => Llada2::load(c, w),
        ModelConfig::Dream(c) => Dream::load(c, w),
        other => Err(crate::Error::UnsupportedModel(format!("{} is not a diffusion model", other.model_type()))),
    }
}

/// Loads one rank of the diffusion model `config` describes, split over a tensor-parallel group
/// ([`DenseDiffusion::load_shard`]; with `expert_parallel`, MoE layers' experts split whole:
/// [`DenseDiffusion::load_expert_shard`]).
pub fn load_shard(
    config: &ModelConfig,
    w: &Weights,
    rank: crate::parallel::TpRank,
    comm: std::sync::Arc<dyn crate::parallel::Communicator>,
    expert_parallel: bool,
) -> crate::Result<DenseDiffusion> {
    match expert_parallel {
        true => DenseDiffusion::load_expert_shard(&arch(config)?, w, rank, comm),
        false => DenseDiffusion::load_shard(&arch(config)?, w, rank, comm),
    }
}

/// Whether the model `config` describes has mixture-of-experts layers.
pub(crate) fn has_experts(config: &ModelConfig) -> bool {
    arch(config).is_ok_and(|a| a.moe.is_some_and(|m| m.moe_layers.contains(&true)))
}

/// The layer stack `config` describes, its fields checked.
fn arch(config: &ModelConfig) -> crate::Result<DenseArch> {
    match config {
        ModelConfig::Sdar(c) => c.validate("SdarConfig").map(|_| Sdar::arch(c)),
        ModelConfig::Llada(c) => c.validate("LladaConfig").map(|_| Llada::arch(c)),
        ModelConfig::Llada2(c) => c.validate("Llada2Config").map(|_| Llada2::arch(c)),
        ModelConfig::Dream(c) => c.validate("DreamConfig").map(|_| Dream::arch(c)),
        other => Err(crate::Error::UnsupportedModel(format!("{} is not a diffusion model", other.model_type()))),
    }
}

pub use crate::diffusion::DiffusionAttention;

/// What the scheduler, runner and metrics need to know about a diffusion model.
#[derive(Debug, Clone, PartialEq)]
pub struct DiffusionSpec {
    /// `config.json`'s `model_type` (`sdar`, `llada`, `Dream`).
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub mask_token_id: u32,
    pub attention: DiffusionAttention,
    /// Logits at position `i` predict token `i + 1` (Dream, initialised from an AR model).
    pub shift_logits: bool,
    /// The block length the checkpoint was trained with, when its config names one.
    pub block_length: Option<usize>,
    /// The confidence threshold the family's releases decode with: the unmask policy when none
    /// is set (`None`: 0.9).
    pub unmask_threshold: Option<f32>,
    /// How the family's own `generate` samples a step's tokens at temperature > 0.
    pub sampler: crate::diffusion::DiffusionSampler,
    pub max_context: usize,
    /// Parameters one token touches in the layers (no embedding, no LM head).
    pub layer_params: u64,
    /// Parameters of the LM head (touched only by tokens whose logits are read).
    pub head_params: u64,
    pub dtype: DType,
    /// Bytes the model's weights occupy as stored (an FP8 layer: a byte a value and its
    /// scales).
    pub weight_bytes: u64,
}

/// One layer's projections of a batch of tokens, post q/k norm and post RoPE.
#[derive(Debug, Clone)]
pub struct Projected {
    /// `[tokens, heads, head_dim]`.
    pub q: Tensor,
    /// `[tokens, kv_heads, head_dim]`.
    pub k: Tensor,
    /// `[tokens, kv_heads, head_dim]`.
    pub v: Tensor,
}

/// A diffusion LM as layers. Implementations own weights only (never KV or request state).
pub trait DiffusionModel: Send {
    fn spec(&self) -> &DiffusionSpec;
    fn device(&self) -> &Device;
    /// Token embeddings `[tokens, hidden]` of `ids` (`[tokens]` u32).
    fn embed(&self, ids: &Tensor) -> Result<Tensor>;
    /// RoPE angles for absolute `positions` (`[tokens]` u32).
    fn rope(&self, positions: &Tensor) -> Result<RopeAngles>;
    /// Layer `l`'s first half over the residual stream `h` `[tokens, hidden]`. (With partial
    /// RoPE — LLaDA2.0 — q and k, and so the K cache, hold each head's dims in the permuted order
    /// of `DenseDiffusion`; dot products are unchanged, a dim-wise comparison with the released
    /// code's tensors is not.)
    fn project(&self, l: usize, h: &Tensor, rope: &RopeAngles) -> Result<Projected>;
    /// Layer `l`'s second half: paged attention of `q` over the cache (the K/V of this launch's
    /// tokens already written), output projection, residual, MLP, residual → new `h`. `h` and `q`
    /// hold the same tokens, in `batch`'s packed order.
    fn finish_layer(&self, l: usize, h: &Tensor, q: &Tensor, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor>;
    /// Final norm and LM head over `h` `[n, hidden]` → f32 logits `[n, vocab]`.
    fn head(&self, h: &Tensor) -> Result<Tensor>;
    /// Like [`DiffusionModel::head`] but in the model dtype (its f32 conversion is exactly
    /// `head`): the runner reduces bf16 logits to a token and its probability in one pass
    /// instead of materialising `[n, vocab]` in f32.
    fn head_native(&self, h: &Tensor) -> Result<Tensor> {
        self.head(h)
    }

    /// The sum of `t` over the ranks of a tensor-parallel group (the model itself on one
    /// device): per-head quantities a rank computed over its own heads, such as FOCUS's
    /// importance, summed to the whole model's, the same bits on every rank.
    fn sum_over_ranks(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }

    /// Layer `l`'s first half with this launch's K/V written into `batch`'s cache rows.
    fn project_write(&self, l: usize, h: &Tensor, rope: &RopeAngles, batch: &PagedBatch, kv: &KvStore) -> Result<Projected> {
        let p = self.project(l, h, rope)?;
        crate::ops::write_kv(kv.k(l), &p.k, batch)?;
        crate::ops::write_kv(kv.v(l), &p.v, batch)?;
        Ok(p)
    }

    /// One whole layer: project, write this launch's K/V, finish.
    fn layer(&self, l: usize, h: &Tensor, rope: &RopeAngles, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        let p = self.project_write(l, h, rope, batch, kv)?;
        self.finish_layer(l, h, &p.q, batch, kv)
    }

    /// Every layer over embedded tokens → final residual stream (before the final norm).
    fn forward(&self, h: &Tensor, rope: &RopeAngles, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        let mut h = h.clone();
        for l in 0..self.spec().num_layers {
            h = self.layer(l, &h, rope, batch, kv)?;
        }
        Ok(h)
    }
}
