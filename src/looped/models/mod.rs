//! Looped LMs exposed as stages: prelude → core step × r → coda. Every stage works on a packed
//! batch of rows, and rows of one core-step launch may sit at different loop steps (each brings
//! the block table of its own cache slot in the `PagedBatch`).

mod arena;
mod config;
mod huginn;
mod initial_state;
mod ouro;

pub use config::{HuginnConfig, OuroConfig};
pub use huginn::Huginn;
pub use initial_state::InitialState;
pub use ouro::Ouro;

use crate::kv::KvStore;
use crate::ops::{PagedBatch, RopeAngles};
use candle_core::{DType, Device, Result, Tensor};

/// What a scheduler and the metrics need to know about a looped model.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopedSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the loop state carried between stages (the state bank's rows): `hidden_size`
    /// for Ouro, `2 · hidden_size` for Huginn (`[s | e]`). The first `hidden_size` columns are
    /// the state proper (the latent difference is measured on them).
    pub state_width: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Physical attention layers with a KV cache per slot (all core layers for Ouro).
    pub num_kv_layers: usize,
    /// r_max: the loop count the model was trained for.
    pub max_steps: usize,
    pub max_context: usize,
    /// Parameters touched once per token outside the loop (F0 in the CDB bound).
    pub boundary_params: u64,
    /// Parameters touched per loop step (Fr in the CDB bound).
    pub step_params: u64,
    /// Of `boundary_params`, the LM head's (run only at sampled positions).
    pub head_params: u64,
    /// Attention layers a loop step runs, and the prelude's and coda's (0 for Ouro, whose prelude
    /// is the embedding and coda the head): what each row's attention reads K/V for.
    pub core_attention_layers: usize,
    pub prelude_attention_layers: usize,
    pub coda_attention_layers: usize,
    /// The coda runs transformer blocks (Huginn), so depth schedulers hold it for a larger
    /// batch by default (a quarter of the width).
    pub heavy_coda: bool,
    pub dtype: DType,
    /// Bytes the model's weights occupy as stored (an FP8 layer: a byte a value and its
    /// scales).
    pub weight_bytes: u64,
    /// Of them, what one loop step reads (the `step_params` as stored) and what the boundary
    /// stages read (the `boundary_params`): the weight side of a launch's roofline.
    pub step_bytes: u64,
    pub boundary_bytes: u64,
}

impl LoopedSpec {
    /// The FLOP speed-up bound S = (F0 + r_max·Fr) / (F0 + d̄·Fr) for mean exit depth `mean_depth`.
    pub fn flop_bound(&self, mean_depth: f64) -> f64 {
        let f0 = self.boundary_params as f64;
        let fr = self.step_params as f64;
        (f0 + self.max_steps as f64 * fr) / (f0 + mean_depth * fr)
    }
}

/// Per-launch inputs shared by every stage and layer (RoPE angles of the packed positions).
#[derive(Debug, Clone)]
pub struct StageInput {
    pub rope: RopeAngles,
    /// `[tokens]` u32 absolute positions (Huginn's seeded initial state is looked up by them).
    pub positions: Tensor,
}

/// Output of one core step over a batch of tokens.
#[derive(Debug, Clone)]
pub struct CoreOut {
    /// `[tokens, hidden]` state after the step.
    pub hidden: Tensor,
    /// `[tokens]` f32 exit-gate logit of the step (Ouro), or `None` for models without a gate.
    pub gate_logit: Option<Tensor>,
}

/// A looped LM as stages. Implementations own weights only.
pub trait LoopedModel: Send {
    fn spec(&self) -> &LoopedSpec;
    fn device(&self) -> &Device;
    /// Builds the per-launch inputs for absolute `positions` (`[tokens]` u32).
    fn prepare(&self, positions: &Tensor) -> Result<StageInput>;
    /// Prelude over `ids` (`[tokens]` u32) → `[tokens, hidden]`. Writes KV only for models
    /// whose prelude has attention layers.
    fn prelude(&self, ids: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor>;
    /// One application of the recurrent core; writes the step's K/V into `batch`'s blocks.
    fn core_step(&self, h: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<CoreOut>;
    /// Coda over exited states `[tokens, state_width]` → `[tokens, hidden]`; writes the coda
    /// blocks' KV for models that have them (every prompt token in a prefill).
    fn coda(&self, state: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor>;
    /// LM head over coda outputs `[rows, hidden]` → f32 logits `[rows, vocab]`. Ouro and Huginn
    /// compute them with `ops::linear_f32`: on CUDA in bf16 / f16 not rounded to the
    /// weights' dtype (one GEMM storing f32), elsewhere the product in that dtype, then cast.
    fn head(&self, h: &Tensor) -> Result<Tensor>;
    /// [`Self::head`] written into `out` (`[rows, vocab]` f32) where the model has a decode arena
    /// (a captured graph's logits go straight to its static output); `false`: not written, call
    /// `head`.
    fn head_into(&self, h: &Tensor, out: &Tensor) -> Result<bool> {
        let _ = (h, out);
        Ok(false)
    }
    /// Computes the per-step gate logit with `head` instead of the checkpoint's own exit gate
    /// (a trained lookahead head, [`crate::looped::gate::LearnedLookahead`]). Models without a gate head
    /// refuse.
    fn replace_gate_head(&mut self, head: &crate::looped::gate::GateHead) -> crate::Result<()> {
        let _ = head;
        Err(crate::Error::InvalidOption("this model has no exit-gate head to replace".into()))
    }
    /// Preallocates the activations of a decode body for launches of up to `rows` rows
    /// (`KernelPolicy::decode_arena`): later core steps of at most that many rows write every
    /// intermediate into those buffers (`ops::into`), none allocated, and return their state in
    /// one of them — valid until the core step after next. Returns whether the model has such a
    /// body for its weights; the default has none.
    fn install_decode_arena(&mut self, rows: usize) -> crate::Result<bool> {
        let _ = rows;
        Ok(false)
    }
    /// Device bytes [`Self::install_decode_arena`] takes for `rows` rows (0 without an arena
    /// body), counted against the device's memory before the KV pool is sized.
    fn decode_arena_bytes(&self, rows: usize) -> u64 {
        let _ = rows;
        0
    }
    /// Whether `core_step` computes the gate logit (off when no gate reads it). Default: no-op.
    fn set_gate_logit(&mut self, on: bool) {
        let _ = on;
    }
    /// `head` applied to the prelude output of every vocabulary token: row-major
    /// `[vocab, head.rows]` f32 (a preloop gate's depth table). Only models whose prelude is
    /// the token embedding alone have one; others refuse.
    fn prelude_head_table(&self, head: &crate::looped::gate::GateHead) -> crate::Result<Vec<f32>> {
        let _ = head;
        Err(crate::Error::InvalidOption("a preloop gate needs a model whose prelude is the token embedding alone (Ouro)".into()))
    }
}
