//! Huginn-0125 (Geiping et al., "Scaling up test-time compute with latent reasoning", 2025):
//! 2 prelude, 4 recurrent core and 2 coda sandwich blocks around a loop state.
//!
//! Stages: prelude = embedding × √h + prelude blocks (write KV), state s₀ = 0 (as the CDB
//! authors serve it); core step = adapter(concat[s, e]) + core blocks; coda = ln_f + coda
//! blocks (write KV) + ln_f; head = tied LM head. The loop state carried between stages is
//! `[s | e]` (2h wide): every step needs the prelude output e again.

use super::{CoreOut, InitialState, LoopedModel, LoopedSpec, StageInput};
use crate::kv::KvStore;
use crate::loader::Weights;
use crate::looped::models::HuginnConfig;
use crate::ops::Linear;
use crate::ops::{self, paged_attention, qkv_bias_rope_i_write, PagedBatch, RopeTable};
use crate::parallel::TpShard;
use candle_core::{Device, Result, Tensor, D};

/// A sandwich block: both residual sums are normalised.
#[derive(Debug, Clone)]
struct Block {
    wqkv: Linear,
    qk_bias: Option<(Tensor, Tensor)>,
    proj: Linear,
    fc: Linear,
    mlp_proj: Linear,
    norms: [Tensor; 4],
    /// Index of this block's cache in the KV store.
    kv_layer: usize,
}

/// The Huginn model. Weights only; cloning shares the weight tensors.
#[derive(Debug, Clone)]
pub struct Huginn {
    cfg: HuginnConfig,
    spec: LoopedSpec,
    wte: Tensor,
    embed_scale: f64,
    prelude: Vec<Block>,
    core: Vec<Block>,
    coda: Vec<Block>,
    adapter: Linear,
    ln_f: Tensor,
    lm_head: Linear,
    rope: RopeTable,
    device: Device,
    initial_state: InitialState,
    /// `[max_context, hidden]` s0 per position, when the initial state is not zero.
    s0_table: Option<Tensor>,
    /// A tensor-parallel rank holds its heads and MLP columns of every block.
    tp: Option<TpShard>,
}

impl Huginn {
    pub fn load(cfg: &HuginnConfig, w: &Weights) -> crate::Result<Self> {
        Self::load_with(cfg, w, None)
    }

    /// Rank `rank` of a tensor-parallel Huginn (as `Ouro::load_shard`): every block's heads
    /// (with their q/k biases), MLP columns and rows of the head (vocabulary-parallel, the logits
    /// gathered); the embedding, adapter and norms whole.
    pub fn load_shard(
        cfg: &HuginnConfig,
        w: &Weights,
        rank: crate::parallel::TpRank,
        comm: std::sync::Arc<dyn crate::parallel::Communicator>,
    ) -> crate::Result<Self> {
        Self::load_with(cfg, w, Some(TpShard::new(rank, comm)?))
    }

    fn load_with(cfg: &HuginnConfig, w: &Weights, tp: Option<TpShard>) -> crate::Result<Self> {
        let (h, i, rows) = (cfg.n_embd, cfg.intermediate_size, cfg.table_rows());
        let (nh, nkv, hd) = (cfg.n_heads, cfg.kv_heads(), cfg.head_dim());
        let block = |name: String, kv_layer: usize| -> crate::Result<Block> {
            let mut qk_bias = if cfg.qk_bias {
                let b = w.get((2, 1, nh, hd), &format!("{name}.attn.qk_bias"))?;
                Some((b.get(0)?.squeeze(0)?, b.get(1)?.squeeze(0)?))
            } else {
                None
            };
            let norms = [1, 2, 3, 4].map(|n| w.get(h, &format!("{name}.norm_{n}.weight")));
            let [n1, n2, n3, n4] = norms;
            let mut wqkv = w.linear_cat(&[(format!("{name}.attn.Wqkv.weight"), ((nh + 2 * nkv) * hd, h))], None)?;
            let mut proj = w.linear_cat(&[(format!("{name}.attn.proj.weight"), (h, nh * hd))], None)?;
            let mut fc = w.linear_cat(&[(format!("{name}.mlp.fc.weight"), (2 * i, h))], None)?;
            let mut mlp_proj = w.linear_cat(&[(format!("{name}.mlp.proj.weight"), (h, i))], None)?;
            if let Some(TpShard { rank, .. }) = &tp {
                (wqkv, proj) = rank.attention(&wqkv, &proj, nh, nkv, hd)?;
                (fc, mlp_proj) = rank.mlp(&fc, &mlp_proj, i)?;
                // The biases `[heads, hd]` of this rank's q and k heads.
                if let Some((bq, bk)) = qk_bias {
                    let (q, k) = (rank.share(nh, 1, "attention heads")?, rank.kv_share(nkv, nh)?);
                    qk_bias = Some((bq.narrow(0, q.start, q.len())?, bk.narrow(0, k.start, k.len())?));
                }
            }
            Ok(Block { wqkv, qk_bias, proj, fc, mlp_proj, norms: [n1?, n2?, n3?, n4?], kv_layer })
        };
        let (p, c) = (cfg.n_layers_in_prelude, cfg.n_layers_in_recurrent_block);
        w.check_layer_count("transformer.prelude", p, "n_layers_in_prelude")?;
        w.check_layer_count("transformer.core_block", c, "n_layers_in_recurrent_block")?;
        w.check_layer_count("transformer.coda", cfg.n_layers_in_coda, "n_layers_in_coda")?;
        let prelude = (0..p).map(|j| block(format!("transformer.prelude.{j}"), j)).collect::<crate::Result<Vec<_>>>()?;
        let core = (0..c).map(|j| block(format!("transformer.core_block.{j}"), p + j)).collect::<crate::Result<Vec<_>>>()?;
        let coda = (0..cfg.n_layers_in_coda).map(|j| block(format!("transformer.coda.{j}"), p + c + j)).collect::<crate::Result<Vec<_>>>()?;
        let wte = w.get((rows, h), "transformer.wte.weight")?;
        // The checkpoint stores the tied embedding twice; an untied head would be read the same way.
        let lm_head = if w.contains("lm_head.weight") { w.get((rows, h), "lm_head.weight")? } else { wte.clone() };
        // A tensor-parallel rank holds its share of the head's rows (vocabulary-parallel).
        let lm_head = match &tp {
            Some(t) => t.rank.vocab_share(&lm_head)?,
            None => lm_head,
        };
        let adapter = w.linear_cat(&[("transformer.adapter.weight".to_string(), (h, 2 * h))], None)?;
        let ln_f = w.get(h, "transformer.ln_f.weight")?;
        let block_bytes = |b: &Block| {
            b.wqkv.bytes()
                + b.proj.bytes()
                + b.fc.bytes()
                + b.mlp_proj.bytes()
                + b.norms.iter().map(ops::bytes_of).sum::<u64>()
                + b.qk_bias.as_ref().map_or(0, |(q, k)| ops::bytes_of(q) + ops::bytes_of(k))
        };
        let step_bytes = core.iter().map(block_bytes).sum::<u64>() + adapter.bytes();
        let boundary_bytes = prelude.iter().chain(&coda).map(block_bytes).sum::<u64>() + ops::bytes_of(&ln_f) + ops::bytes_of(&lm_head);
        let weight_bytes = step_bytes + boundary_bytes + ops::bytes_of(&wte) - if w.contains("lm_head.weight") { 0 } else { ops::bytes_of(&lm_head) };
        let block_params = (((nh + 2 * nkv) * hd + nh * hd) * h + 3 * h * i + 2 * nh * hd + 4 * h) as u64;
        // A rank attends with its own heads.
        let ranks = tp.as_ref().map_or(1, |t| t.rank.world);
        let spec = LoopedSpec {
            vocab_size: cfg.vocab_size,
            hidden_size: h,
            state_width: 2 * h,
            num_heads: nh / ranks,
            num_kv_heads: tp.as_ref().map_or(nkv, |t| t.rank.kv_heads_per_rank(nkv)),
            head_dim: hd,
            num_kv_layers: cfg.num_layers(),
            max_steps: cfg.max_steps,
            max_context: cfg.block_size,
            // CDB counting: F0 = prelude + coda blocks + ln_f + head; Fr = adapter + core blocks.
            boundary_params: (p + cfg.n_layers_in_coda) as u64 * block_params + (h + rows * h) as u64,
            step_params: c as u64 * block_params + (2 * h * h) as u64,
            head_params: (rows * h) as u64,
            core_attention_layers: c,
            prelude_attention_layers: p,
            coda_attention_layers: cfg.n_layers_in_coda,
            heavy_coda: true,
            dtype: w.dtype(),
            weight_bytes,
            step_bytes,
            boundary_bytes,
        };
        Ok(Self {
            rope: RopeTable::new(hd, cfg.rope_base, w.dtype(), w.device())?,
            embed_scale: (h as f64).sqrt(),
            adapter,
            ln_f,
            lm_head: Linear::dense(lm_head, None),
            wte,
            prelude,
            core,
            coda,
            spec,
            cfg: cfg.clone(),
            device: w.device().clone(),
            initial_state: InitialState::Zeros,
            s0_table: None,
            tp,
        })
    }

    /// Starts every token's recurrence from `init` instead of the zero state (upstream's seeded
    /// truncated normal; see [`InitialState`]). Builds a `[max_context, hidden]` table once.
    pub fn with_initial_state(mut self, init: InitialState) -> crate::Result<Self> {
        init.validate()?;
        self.s0_table = init.table(self.spec.max_context, self.spec.hidden_size, self.spec.dtype, &self.device)?;
        self.initial_state = init;
        Ok(self)
    }

    pub fn initial_state(&self) -> InitialState {
        self.initial_state
    }

    fn block_forward(&self, b: &Block, x: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        let eps = self.cfg.norm_eps;
        let (nh, nkv, hd) = (self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        let t = x.dim(0)?;
        let qkv = b.wqkv.forward(&ops::rms_norm(x, &b.norms[0], eps)?)?;
        // The learned bias is added before RoPE; one launch on CUDA with the K/V writes.
        let bias = b.qk_bias.as_ref().map(|(q, k)| (q, k));
        let q = qkv_bias_rope_i_write(&qkv, bias, &input.rope, kv.k(b.kv_layer), kv.v(b.kv_layer), batch, nh, nkv, hd)?;
        let attn = paged_attention(&q, kv.k(b.kv_layer), kv.v(b.kv_layer), batch, 1.0 / (hd as f64).sqrt())?;
        // Norms after each residual add (Huginn's sandwich): the projection, the add and the norm
        // in one op (at decode widths the projection as partial products the norm sums).
        let attn = attn.reshape((t, nh * hd))?;
        if let Some(tp) = &self.tp {
            // Each rank's heads and columns give a partial output; their sum is the block's.
            let (_, x) = ops::residual_add_rms_norm(x, &tp.sum(&b.proj.forward(&attn)?)?, &b.norms[1], eps)?;
            let m = ops::silu_mul(&b.fc.forward(&ops::rms_norm(&x, &b.norms[2], eps)?)?)?;
            return Ok(ops::residual_add_rms_norm(&x, &tp.sum(&b.mlp_proj.forward(&m)?)?, &b.norms[3], eps)?.1);
        }
        let (_, x) = b.proj.residual_add_rms_norm(x, &attn, &b.norms[1], eps)?;
        let m = ops::silu_mul(&b.fc.forward(&ops::rms_norm(&x, &b.norms[2], eps)?)?)?;
        Ok(b.mlp_proj.residual_add_rms_norm(&x, &m, &b.norms[3], eps)?.1)
    }

    fn blocks(&self, blocks: &[Block], x: Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        blocks.iter().try_fold(x, |x, b| self.block_forward(b, &x, input, batch, kv))
    }
}

impl LoopedModel for Huginn {
    fn spec(&self) -> &LoopedSpec {
        &self.spec
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn prepare(&self, positions: &Tensor) -> Result<StageInput> {
        Ok(StageInput { rope: self.rope.angles(positions)?, positions: positions.clone() })
    }

    fn prelude(&self, ids: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        let e = (self.wte.index_select(ids, 0)? * self.embed_scale)?;
        let e = self.blocks(&self.prelude, e, input, batch, kv)?;
        let s0 = match &self.s0_table {
            Some(table) => table.index_select(&input.positions, 0)?,
            None => e.zeros_like()?,
        };
        Tensor::cat(&[&s0, &e], D::Minus1)
    }

    fn core_step(&self, state: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<CoreOut> {
        let h = self.spec.hidden_size;
        // The adapter's input is concat[s, e], which is exactly the carried state.
        let x = self.adapter.forward(state)?;
        let s = self.blocks(&self.core, x, input, batch, kv)?;
        let e = state.narrow(D::Minus1, h, h)?;
        Ok(CoreOut { hidden: Tensor::cat(&[&s, &e], D::Minus1)?, gate_logit: None })
    }

    fn coda(&self, state: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        let s = state.narrow(D::Minus1, 0, self.spec.hidden_size)?;
        let x = ops::rms_norm(&s.contiguous()?, &self.ln_f, self.cfg.norm_eps)?;
        let x = self.blocks(&self.coda, x, input, batch, kv)?;
        ops::rms_norm(&x, &self.ln_f, self.cfg.norm_eps)
    }

    fn head(&self, h: &Tensor) -> Result<Tensor> {
        // The head has a row per padded-vocabulary entry; padding rows are not tokens.
        match &self.tp {
            Some(tp) => tp.gather_vocab(&ops::linear_f32(h, &*self.lm_head.weight()?)?, self.spec.vocab_size),
            None => ops::linear_f32(h, &self.lm_head.weight()?.narrow(0, 0, self.spec.vocab_size)?),
        }
    }
}
