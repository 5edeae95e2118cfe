//! Huginn-0125 (Geiping et al., "Scaling up test-time compute with latent reasoning", 2025):
//! 2 prelude, 4 recurrent core and 2 coda sandwich blocks around a loop state.
//!
//! Stages: prelude = embedding × √h + prelude blocks (write KV), state s₀ = 0 (as the CDB
//! authors serve it); core step = adapter(concat[s, e]) + core blocks; coda = ln_f + coda
//! blocks (write KV) + ln_f; head = tied LM head. The loop state carried between stages is
//! `[s | e]` (2h wide): every step needs the prelude output e again.

use super::arena::{self, dense, weight, RopeBuffers, Turns};
use super::{CoreOut, InitialState, LoopedModel, LoopedSpec, StageInput};
use crate::kv::KvStore;
use crate::loader::Weights;
use crate::looped::models::HuginnConfig;
use crate::ops::into::{self, AttentionScratch, NormAfter};
use crate::ops::{self, paged_attention, qkv_bias_rope_i_write, Linear, PagedBatch, RopeTable};
use crate::parallel::TpShard;
use candle_core::{Device, Result, Tensor, D};
use std::sync::Arc;

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
    /// The decode stages' buffers where the engine runs them on an arena (shared by clones).
    arena: Option<Arc<Arena>>,
}

/// Every activation of Huginn's decode stages over up to `rows` rows, allocated once
/// (`LoopedModel::install_decode_arena`): the prelude, the core step and the coda each write
/// their output into their own buffers, and their blocks share the rest.
#[derive(Debug)]
struct Arena {
    rows: usize,
    /// The core step's state `[rows, 2h]` (`[s | e]`): two, used in turn, so that a step's
    /// output can be the next step's input.
    state: Turns<Tensor>,
    /// The prelude's state `[rows, 2h]` and the coda's output `[rows, h]`.
    entered: Tensor,
    coda_out: Tensor,
    /// A chain of blocks' input (the scaled embedding rows, the adapter's output, the coda's
    /// first norm) and the blocks' outputs, two in turn.
    input: Tensor,
    stream: [Tensor; 2],
    /// The s half of a state (the coda's input), or a position's initial state; and the zero
    /// initial state.
    half: Tensor,
    zeros: Tensor,
    /// `2r` for row r: the s halves' rows of a `[rows, 2h]` state read as `[2 rows, h]`.
    evens: Tensor,
    /// Inside a block: the norms' outputs, the residual sum of a chain's last block (not read:
    /// the sandwich norm replaces the stream by its norm), the attention's and the MLP's
    /// activations.
    normed: Tensor,
    sum: Tensor,
    mid: Tensor,
    qkv: Tensor,
    attn: Tensor,
    /// An unsplit projection (`[rows, h]`) and the split-k partials (f32) of one.
    proj: Tensor,
    parts: Tensor,
    fc: Tensor,
    act: Tensor,
    attention: AttentionScratch,
    /// A launch's RoPE angles.
    rope: RopeBuffers,
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
            arena: None,
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

impl Huginn {
    /// Whether the arena body covers this model: dense layers without bias, one device.
    fn has_arena_body(&self) -> bool {
        let layers = self.prelude.iter().chain(&self.core).chain(&self.coda).flat_map(|b| [&b.wqkv, &b.proj, &b.fc, &b.mlp_proj]);
        self.tp.is_none() && dense(&self.adapter).is_some() && layers.into_iter().all(|l| dense(l).is_some())
    }

    /// The arena and the launch's token count, where an arena is installed and holds the launch
    /// (`x`'s first dim).
    fn arena_for(&self, x: &Tensor) -> Option<(&Arena, usize)> {
        let ar = self.arena.as_deref()?;
        Some((ar, arena::rows_within(ar.rows, x)?))
    }

    /// [`Self::block_forward`] on the arena: the same values, each written into its buffer
    /// (`ops::into`); the block's output goes to `out`. Each norm that reads a sandwich norm's
    /// output runs in that norm's launch: the block's own MLP norm, and with `next` (the
    /// following block's first norm weight) the next block's input norm, left in `ar.normed`
    /// for it — `normed_in` says this block's is there already.
    #[allow(clippy::too_many_arguments)]
    fn block_in(
        &self,
        b: &Block,
        x: &Tensor,
        (normed_in, next): (bool, Option<&Tensor>),
        out: &Tensor,
        input: &StageInput,
        batch: &PagedBatch,
        kv: &KvStore,
        ar: &Arena,
    ) -> Result<()> {
        let t = x.dim(0)?;
        let eps = self.cfg.norm_eps;
        let (nh, nkv, hd) = (self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        let rows = |b: &Tensor| b.narrow(0, 0, t);
        let (normed, mid, qkv, attn) = (rows(&ar.normed)?, rows(&ar.mid)?, rows(&ar.qkv)?, rows(&ar.attn)?);
        let (proj, fc, act) = (rows(&ar.proj)?, rows(&ar.fc)?, rows(&ar.act)?);
        if !normed_in {
            into::rms_norm_into(x, &b.norms[0], eps, &normed)?;
        }
        into::linear_into(&normed, weight(&b.wqkv)?, &qkv)?;
        let bias = b.qk_bias.as_ref().map(|(q, k)| (q, k));
        let (k_cache, v_cache) = (kv.k(b.kv_layer), kv.v(b.kv_layer));
        let scale = 1.0 / (hd as f64).sqrt();
        into::qkv_bias_rope_i_attention_into(
            &qkv,
            bias,
            &input.rope,
            k_cache,
            v_cache,
            batch,
            (nh, nkv, hd),
            scale,
            &ar.attention,
            &attn.reshape((t, nh, hd))?,
        )?;
        let norm = NormAfter::PostNorm { w: &b.norms[1], w_next: &b.norms[2] };
        into::linear_norm_into(x, &attn, weight(&b.proj)?, norm, eps, (&proj, &ar.parts), &mid, &normed)?;
        into::linear_into(&normed, weight(&b.fc)?, &fc)?;
        into::silu_mul_into(&fc, &act)?;
        let mlp_proj = weight(&b.mlp_proj)?;
        match next {
            Some(w_next) => into::linear_norm_into(&mid, &act, mlp_proj, NormAfter::PostNorm { w: &b.norms[3], w_next }, eps, (&proj, &ar.parts), out, &normed),
            None => into::linear_norm_into(&mid, &act, mlp_proj, NormAfter::PreNorm { w: &b.norms[3] }, eps, (&proj, &ar.parts), &rows(&ar.sum)?, out),
        }
    }

    /// A chain of blocks on the arena from `x` (`ar.input`): each block's output in one of
    /// `ar.stream`, in turn; returns the last.
    fn blocks_in(&self, blocks: &[Block], x: Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore, ar: &Arena) -> Result<Tensor> {
        let t = x.dim(0)?;
        let mut x = x;
        for (j, b) in blocks.iter().enumerate() {
            let out = ar.stream[j % 2].narrow(0, 0, t)?;
            let next = blocks.get(j + 1).map(|n| &n.norms[0]);
            self.block_in(b, &x, (j > 0, next), &out, input, batch, kv, ar)?;
            x = out;
        }
        Ok(x)
    }

    /// The prelude on the arena: the scaled embedding rows through the prelude blocks into the e
    /// half of `ar.entered`, the initial state into its s half.
    fn prelude_in(&self, ids: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore, ar: &Arena, t: usize) -> Result<Tensor> {
        let h = self.spec.hidden_size;
        let x = ar.input.narrow(0, 0, t)?;
        into::gather_rows_scaled_into(&self.wte, ids, self.embed_scale, &x)?;
        let e = self.blocks_in(&self.prelude, x, input, batch, kv, ar)?;
        let out = ar.entered.narrow(0, 0, t)?;
        into::write_columns(&out, h, &e)?;
        match &self.s0_table {
            Some(table) => {
                let s0 = ar.half.narrow(0, 0, t)?;
                into::gather_rows_into(table, &input.positions, &s0)?;
                into::write_columns(&out, 0, &s0)?;
            }
            None => into::write_columns(&out, 0, &ar.zeros.narrow(0, 0, t)?)?,
        }
        Ok(out)
    }

    /// The core step on the arena: the adapter over `[s | e]`, the core blocks, and the new
    /// state `[s' | e]` in one of `ar.state`.
    fn core_step_in(&self, state: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore, ar: &Arena, t: usize) -> Result<CoreOut> {
        let x = ar.input.narrow(0, 0, t)?;
        into::linear_into(state, weight(&self.adapter)?, &x)?;
        let s = self.blocks_in(&self.core, x, input, batch, kv, ar)?;
        let out = ar.state.next().narrow(0, 0, t)?;
        // The e half carries over: the whole state copied, then s written over its half.
        into::copy_into(&out, state)?;
        into::write_columns(&out, 0, &s)?;
        crate::ops::policy::count(|c| c.arena_steps += 1);
        Ok(CoreOut { hidden: out, gate_logit: None })
    }

    /// The coda on the arena: the s half of each state row (row 2r of the state read as
    /// `[2 rows, h]`), `ln_f`, the coda blocks and `ln_f` again into `ar.coda_out`.
    fn coda_in(&self, state: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore, ar: &Arena, t: usize) -> Result<Tensor> {
        let (h, eps) = (self.spec.hidden_size, self.cfg.norm_eps);
        let s = ar.half.narrow(0, 0, t)?;
        into::gather_rows_into(&state.reshape((2 * t, h))?, &ar.evens.narrow(0, 0, t)?, &s)?;
        let x = ar.input.narrow(0, 0, t)?;
        into::rms_norm_into(&s, &self.ln_f, eps, &x)?;
        let y = self.blocks_in(&self.coda, x, input, batch, kv, ar)?;
        let out = ar.coda_out.narrow(0, 0, t)?;
        into::rms_norm_into(&y, &self.ln_f, eps, &out)?;
        Ok(out)
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
        if let Some((ar, t)) = self.arena_for(positions) {
            return Ok(StageInput { rope: ar.rope.angles(&self.rope, positions, t)?, positions: positions.clone() });
        }
        Ok(StageInput { rope: self.rope.angles(positions)?, positions: positions.clone() })
    }

    fn prelude(&self, ids: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        if let Some((ar, t)) = self.arena_for(ids) {
            return self.prelude_in(ids, input, batch, kv, ar, t);
        }
        let e = (self.wte.index_select(ids, 0)? * self.embed_scale)?;
        let e = self.blocks(&self.prelude, e, input, batch, kv)?;
        let s0 = match &self.s0_table {
            Some(table) => table.index_select(&input.positions, 0)?,
            None => e.zeros_like()?,
        };
        Tensor::cat(&[&s0, &e], D::Minus1)
    }

    fn core_step(&self, state: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<CoreOut> {
        if let Some((ar, t)) = self.arena_for(state) {
            return self.core_step_in(state, input, batch, kv, ar, t);
        }
        let h = self.spec.hidden_size;
        // The adapter's input is concat[s, e], which is exactly the carried state.
        let x = self.adapter.forward(state)?;
        let s = self.blocks(&self.core, x, input, batch, kv)?;
        let e = state.narrow(D::Minus1, h, h)?;
        Ok(CoreOut { hidden: Tensor::cat(&[&s, &e], D::Minus1)?, gate_logit: None })
    }

    fn coda(&self, state: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        if let Some((ar, t)) = self.arena_for(state) {
            return self.coda_in(state, input, batch, kv, ar, t);
        }
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

    fn head_into(&self, h: &Tensor, out: &Tensor) -> Result<bool> {
        if self.arena.is_none() || self.tp.is_some() {
            return Ok(false);
        }
        into::linear_f32_into(h, &self.lm_head.weight()?.narrow(0, 0, self.spec.vocab_size)?, out)?;
        Ok(true)
    }

    fn install_decode_arena(&mut self, rows: usize) -> crate::Result<bool> {
        if !self.has_arena_body() || rows == 0 {
            self.arena = None;
            return Ok(false);
        }
        let (h, i, dt, dev) = (self.spec.hidden_size, self.cfg.intermediate_size, self.spec.dtype, &self.device);
        let (nh, nkv, hd) = (self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        let buf = |cols: usize| Tensor::zeros((rows, cols), dt, dev);
        let evens: Vec<u32> = (0..rows as u32).map(|r| 2 * r).collect();
        self.arena = Some(Arc::new(Arena {
            rows,
            state: Turns::new([buf(2 * h)?, buf(2 * h)?]),
            entered: buf(2 * h)?,
            coda_out: buf(h)?,
            input: buf(h)?,
            stream: [buf(h)?, buf(h)?],
            half: buf(h)?,
            zeros: buf(h)?,
            evens: Tensor::new(evens.as_slice(), dev)?,
            normed: buf(h)?,
            sum: buf(h)?,
            mid: buf(h)?,
            qkv: buf((nh + 2 * nkv) * hd)?,
            attn: buf(nh * hd)?,
            proj: buf(h)?,
            parts: arena::partials(rows, h, dev)?,
            fc: buf(2 * i)?,
            act: buf(i)?,
            attention: AttentionScratch::new(rows, nh, hd, dt, dev)?,
            rope: arena::rope_buffers(rows, hd, dt, dev)?,
        }));
        Ok(true)
    }

    fn decode_arena_bytes(&self, rows: usize) -> u64 {
        if !self.has_arena_body() {
            return 0;
        }
        let (h, i, nh, nkv, hd) = (self.spec.hidden_size, self.cfg.intermediate_size, self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        // state ×2 and entered (2h each), coda_out, input, stream ×2, half, zeros, normed, sum,
        // mid, proj (h each) and a column more, which covers `evens` (u32 a row); qkv, attn (and
        // attention's q), fc, act; RoPE.
        let cols = 6 * h + 11 * h + (nh + 2 * nkv) * hd + 2 * nh * hd + 3 * i + 2 * hd;
        let activations = (rows * cols * self.spec.dtype.size_in_bytes()) as u64;
        activations + arena::workspace_bytes(rows, h, nh, hd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn tiny(seed: u64) -> (HuginnConfig, Huginn) {
        let cfg = crate::testing::tiny_huginn_config(97);
        let t = crate::testing::random_tensors(&crate::testing::huginn_tensor_manifest(&cfg), seed, DType::F32, &Device::Cpu).unwrap();
        let huginn = Huginn::load(&cfg, &Weights::from_map(t, DType::F32, &Device::Cpu)).unwrap();
        (cfg, huginn)
    }

    /// What the engine counts against device memory for the arena covers what it allocates.
    #[test]
    fn the_arena_is_counted_before_it_is_allocated() {
        let (_, mut huginn) = tiny(3);
        for rows in [1, 16, 64, 512] {
            assert!(huginn.install_decode_arena(rows).unwrap());
            let ar = huginn.arena.as_deref().unwrap();
            let mut tensors = vec![&ar.entered, &ar.coda_out, &ar.input, &ar.half, &ar.zeros, &ar.evens, &ar.normed, &ar.sum, &ar.mid];
            tensors.extend([&ar.qkv, &ar.attn, &ar.proj, &ar.parts, &ar.fc, &ar.act]);
            tensors.extend(ar.state.both().iter().chain(&ar.stream));
            tensors.extend(ar.rope.both().iter().flat_map(|(c, s)| [c, s]));
            let allocated: u64 = tensors.into_iter().map(ops::bytes_of).sum();
            assert!(allocated <= huginn.decode_arena_bytes(rows), "{rows} rows: {allocated} bytes allocated, {} counted", huginn.decode_arena_bytes(rows));
        }
        assert!(!huginn.install_decode_arena(0).unwrap() && huginn.arena.is_none(), "no arena of zero rows");
    }

    /// Every stage on the arena gives the plain body's values, with the zero and the seeded
    /// initial state; consecutive core steps alternate their output buffer; a launch wider
    /// than the arena runs the plain body.
    #[test]
    fn stages_on_the_arena_match_the_plain_body() {
        let (cfg, plain) = tiny(4);
        let seeded = plain.clone().with_initial_state(InitialState::TruncatedNormal { scale: 1.0, seed: 7 }).unwrap();
        for plain in [plain, seeded] {
            let mut arena = plain.clone();
            assert!(arena.install_decode_arena(4).unwrap());
            let layers = cfg.num_layers();
            let kv = |_| KvStore::new(layers, 8, 4, cfg.kv_heads(), cfg.head_dim(), DType::F32, &Device::Cpu).unwrap();
            let (kv_p, kv_a) = (kv(0), kv(1));
            let mut host = ops::PagedBatchHost::new();
            for r in 0..3u32 {
                host.push_row(&[r], 2, 1, None);
            }
            let batch = PagedBatch::new(host, 4, ops::AttnMask::Causal, cfg.kv_heads() * cfg.head_dim(), &Device::Cpu).unwrap();
            let positions = Tensor::new(&[1u32, 1, 1], &Device::Cpu).unwrap();
            let ids = Tensor::new(&[5u32, 9, 11], &Device::Cpu).unwrap();
            let (input_p, input_a) = (plain.prepare(&positions).unwrap(), arena.prepare(&positions).unwrap());
            let mut hp = plain.prelude(&ids, &input_p, &batch, &kv_p).unwrap();
            let mut ha = arena.prelude(&ids, &input_a, &batch, &kv_a).unwrap();
            assert_eq!(hp.to_vec2::<f32>().unwrap(), ha.to_vec2::<f32>().unwrap(), "prelude");
            let (mut outputs, mut values) = (Vec::new(), Vec::new());
            for step in 0..3 {
                hp = plain.core_step(&hp, &input_p, &batch, &kv_p).unwrap().hidden;
                ha = arena.core_step(&ha, &input_a, &batch, &kv_a).unwrap().hidden;
                assert_eq!(hp.to_vec2::<f32>().unwrap(), ha.to_vec2::<f32>().unwrap(), "core step {step}");
                outputs.push(ha.clone());
                values.push(ha.to_vec2::<f32>().unwrap());
            }
            assert_ne!(values[0], values[2]);
            assert_eq!(outputs[0].to_vec2::<f32>().unwrap(), values[2], "the first step's buffer holds the third's state");
            let (yp, ya) = (plain.coda(&hp, &input_p, &batch, &kv_p).unwrap(), arena.coda(&ha, &input_a, &batch, &kv_a).unwrap());
            assert_eq!(yp.to_vec2::<f32>().unwrap(), ya.to_vec2::<f32>().unwrap(), "coda");
            let logits = Tensor::zeros((3, cfg.vocab_size), DType::F32, &Device::Cpu).unwrap();
            assert!(arena.head_into(&ya, &logits).unwrap());
            assert_eq!(plain.head(&yp).unwrap().to_vec2::<f32>().unwrap(), logits.to_vec2::<f32>().unwrap(), "head");
            // The caches the two wrote agree too.
            for l in 0..layers {
                assert_eq!(
                    kv_p.k(l).flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    kv_a.k(l).flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "K of layer {l}"
                );
            }
            let five = Tensor::zeros((5, 2 * cfg.n_embd), DType::F32, &Device::Cpu).unwrap();
            assert!(arena.arena_for(&five).is_none());
        }
    }
}
