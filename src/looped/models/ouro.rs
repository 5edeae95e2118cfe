//! Ouro (ByteDance, arXiv 2510.25741): a Llama-style decoder whose L layers are applied
//! `total_ut_steps` times. Sandwich norm (4 RMSNorms per layer), split-half RoPE, the final
//! norm after every loop, a per-step exit-gate logit and an untied LM head.
//!
//! Stages: prelude = embedding lookup; core step = all L layers + norm + gate; coda = LM head.

use super::arena::{self, dense, weight, RopeBuffers, Turns};
use super::{CoreOut, LoopedModel, LoopedSpec, StageInput};
use crate::kv::KvStore;
use crate::loader::Weights;
use crate::looped::models::OuroConfig;
use crate::ops::into::{self, AttentionScratch, NormAfter};
use crate::ops::{self, Linear, LinearWeight, PagedBatch, RopeTable};
use crate::parallel::TpShard;
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Layer {
    qkv: Linear,
    o_proj: Linear,
    gate_up: Linear,
    down: Linear,
    input_norm: Tensor,
    input_norm_2: Tensor,
    post_attn_norm: Tensor,
    post_attn_norm_2: Tensor,
}

/// The Ouro model. Weights only; cloning shares the weight tensors.
#[derive(Debug, Clone)]
pub struct Ouro {
    cfg: OuroConfig,
    spec: LoopedSpec,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    gate: Linear,
    /// Whether core steps compute the gate logit (off when the engine's gate does not read it).
    gate_on: bool,
    lm_head: Linear,
    rope: RopeTable,
    device: Device,
    /// A tensor-parallel rank holds its heads of q, k, v and o, its columns of the MLP and its
    /// rows of the head (vocabulary-parallel); the embedding, norms and gate are whole on every
    /// rank.
    tp: Option<TpShard>,
    /// The core step's buffers where the engine runs it on an arena (shared by clones).
    arena: Option<Arc<Arena>>,
}

/// Every activation of a core step over up to `rows` rows, allocated once
/// (`LoopedModel::install_decode_arena`).
#[derive(Debug)]
struct Arena {
    rows: usize,
    /// The next layer's input norm; after the last layer, the step's output. Two, used in turn
    /// from step to step, so that a step's output can be the next step's input.
    normed: Turns<Tensor>,
    /// The residual stream between layers; after attention, and its norm (the MLP's input).
    residual: Tensor,
    mid: Tensor,
    mid_normed: Tensor,
    qkv: Tensor,
    attn: Tensor,
    /// An unsplit o_proj or down projection (`[rows, hidden]`).
    proj: Tensor,
    gate_up: Tensor,
    act: Tensor,
    /// Split-k partial products (f32) of o_proj and down.
    parts: Tensor,
    attention: AttentionScratch,
    /// A launch's RoPE angles.
    rope: RopeBuffers,
    /// The prelude's output (the embedding rows).
    embedded: Tensor,
    /// The step's exit-gate logit (f32).
    gate: Tensor,
}

impl Ouro {
    pub fn load(cfg: &OuroConfig, w: &Weights) -> crate::Result<Self> {
        Self::load_with(cfg, w, None)
    }

    /// Rank `rank` of a tensor-parallel Ouro: its share of every layer (whole heads, even
    /// column splits; a typed error when they do not divide), the rest whole; its row-parallel
    /// outputs (attention output, MLP down) are summed over the ranks with `comm` before the
    /// norm that reads them. Every rank's spec names its own heads, so a runner per rank holds
    /// the K/V of those heads only.
    pub fn load_shard(
        cfg: &OuroConfig,
        w: &Weights,
        rank: crate::parallel::TpRank,
        comm: std::sync::Arc<dyn crate::parallel::Communicator>,
    ) -> crate::Result<Self> {
        Self::load_with(cfg, w, Some(TpShard::new(rank, comm)?))
    }

    fn load_with(cfg: &OuroConfig, w: &Weights, tp: Option<TpShard>) -> crate::Result<Self> {
        let (h, v, i) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        w.check_layer_count("model.layers", cfg.num_hidden_layers, "num_hidden_layers")?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let part = |name: &str, shape: (usize, usize)| (format!("{p}.{name}.weight"), shape);
            // q/k/v and gate/up are fused into one matmul each: fewer launches per layer.
            let mut qkv = w.linear_cat(
                &[part("self_attn.q_proj", (nh * hd, h)), part("self_attn.k_proj", (nkv * hd, h)), part("self_attn.v_proj", (nkv * hd, h))],
                None,
            )?;
            let mut o_proj = w.linear_cat(&[part("self_attn.o_proj", (h, nh * hd))], None)?;
            let mut gate_up = w.linear_cat(&[part("mlp.gate_proj", (i, h)), part("mlp.up_proj", (i, h))], None)?;
            let mut down = w.linear_cat(&[part("mlp.down_proj", (h, i))], None)?;
            if let Some(TpShard { rank, .. }) = &tp {
                (qkv, o_proj) = rank.attention(&qkv, &o_proj, nh, nkv, hd)?;
                (gate_up, down) = rank.mlp(&gate_up, &down, i)?;
            }
            layers.push(Layer {
                qkv,
                o_proj,
                gate_up,
                down,
                input_norm: w.get(h, &format!("{p}.input_layernorm.weight"))?,
                input_norm_2: w.get(h, &format!("{p}.input_layernorm_2.weight"))?,
                post_attn_norm: w.get(h, &format!("{p}.post_attention_layernorm.weight"))?,
                post_attn_norm_2: w.get(h, &format!("{p}.post_attention_layernorm_2.weight"))?,
            });
        }
        let embed = w.get((v, h), "model.embed_tokens.weight")?;
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") { embed.clone() } else { w.get((v, h), "lm_head.weight")? };
        // A tensor-parallel rank holds its share of the head's rows (vocabulary-parallel).
        let lm_head = match &tp {
            Some(t) => t.rank.vocab_share(&lm_head)?,
            None => lm_head,
        };
        // The gate runs in f32: its logit feeds a CDF threshold, where bf16 rounding of a
        // single scalar would move exit decisions.
        let gate = Linear::dense(
            w.get((1, h), "model.early_exit_gate.weight")?.to_dtype(DType::F32)?,
            Some(w.get(1, "model.early_exit_gate.bias")?.to_dtype(DType::F32)?),
        );
        let tied = cfg.tie_word_embeddings && !w.contains("lm_head.weight");
        let norm = w.get(h, "model.norm.weight")?;
        let step_bytes = layers
            .iter()
            .map(|l| {
                l.qkv.bytes()
                    + l.o_proj.bytes()
                    + l.gate_up.bytes()
                    + l.down.bytes()
                    + [&l.input_norm, &l.input_norm_2, &l.post_attn_norm, &l.post_attn_norm_2].into_iter().map(ops::bytes_of).sum::<u64>()
            })
            .sum::<u64>()
            + ops::bytes_of(&norm)
            + gate.bytes();
        // The boundary is the head (the embedding lookup reads a row per token).
        let boundary_bytes = ops::bytes_of(&lm_head);
        let weight_bytes = step_bytes + ops::bytes_of(&embed) + if tied { 0 } else { boundary_bytes };
        let layer_params = (2 * nh * hd * h + 2 * nkv * hd * h + 3 * h * i + 4 * h) as u64;
        // A rank attends with its own heads.
        let ranks = tp.as_ref().map_or(1, |t| t.rank.world);
        let spec = LoopedSpec {
            vocab_size: v,
            hidden_size: h,
            state_width: h,
            num_heads: nh / ranks,
            num_kv_heads: tp.as_ref().map_or(nkv, |t| t.rank.kv_heads_per_rank(nkv)),
            head_dim: hd,
            num_kv_layers: cfg.num_hidden_layers,
            max_steps: cfg.total_ut_steps,
            max_context: cfg.max_position_embeddings,
            // Counting rule of the CDB authors: the embedding lookup is free, the head is not.
            boundary_params: (v * h) as u64,
            step_params: layer_params * cfg.num_hidden_layers as u64 + (h + h + 1) as u64,
            head_params: (v * h) as u64,
            core_attention_layers: cfg.num_hidden_layers,
            prelude_attention_layers: 0,
            coda_attention_layers: 0,
            heavy_coda: false,
            dtype: w.dtype(),
            weight_bytes,
            step_bytes,
            boundary_bytes,
        };
        Ok(Self {
            rope: RopeTable::new(hd, cfg.rope_theta, w.dtype(), w.device())?,
            norm,
            gate,
            gate_on: true,
            lm_head: Linear::dense(lm_head, None),
            embed,
            layers,
            spec,
            cfg: cfg.clone(),
            device: w.device().clone(),
            tp,
            arena: None,
        })
    }

    pub fn config(&self) -> &OuroConfig {
        &self.cfg
    }

    /// One layer. `h` is the residual stream and `a = rms_norm(h, input_norm)` of this layer
    /// (computed by the previous layer's last fused norm, or once at the start of the step).
    /// Returns the new residual and its norm by `next_norm` (the next layer's input norm, or the
    /// model's final norm after the last layer).
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        l: usize,
        h: &Tensor,
        a: &Tensor,
        next_norm: &Tensor,
        input: &StageInput,
        batch: &PagedBatch,
        kv: &KvStore,
    ) -> Result<(Tensor, Tensor)> {
        let layer = &self.layers[l];
        let eps = self.cfg.rms_norm_eps;
        let (nh, nkv, hd) = (self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        let t = h.dim(0)?;

        let qkv = layer.qkv.forward(a)?;
        // Rotating q / k, writing k / v to the cache and attending are one kernel for decode
        // launches on CUDA (the decode ring, or the SIMT kernel's fold); elsewhere two ops.
        let attn = ops::qkv_rope_attention(&qkv, &input.rope, kv.k(l), kv.v(l), batch, nh, nkv, hd, 1.0 / (hd as f64).sqrt())?;
        // The projections that feed a norm hand it their output (at decode widths as partial
        // products over k, which the norm sums: `ops::split_k`).
        let attn = attn.reshape((t, nh * hd))?;
        if let Some(tp) = &self.tp {
            // Each rank's heads and columns give a partial output; their sum is the layer's.
            let y = tp.sum(&layer.o_proj.forward(&attn)?)?;
            let (h, m) = ops::add_rms_norm(h, &y, &layer.input_norm_2, &layer.post_attn_norm, eps)?;
            let y = tp.sum(&layer.down.forward(&ops::silu_mul(&layer.gate_up.forward(&m)?)?)?)?;
            return ops::add_rms_norm(&h, &y, &layer.post_attn_norm_2, next_norm, eps);
        }
        let (h, m) = layer.o_proj.add_rms_norm(h, &attn, &layer.input_norm_2, &layer.post_attn_norm, eps)?;

        let m = ops::silu_mul(&layer.gate_up.forward(&m)?)?;
        layer.down.add_rms_norm(&h, &m, &layer.post_attn_norm_2, next_norm, eps)
    }
}

impl Ouro {
    /// Whether the arena body covers this model: dense layers without bias, one device.
    fn has_arena_body(&self) -> bool {
        self.tp.is_none() && self.layers.iter().all(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down].into_iter().all(|p| dense(p).is_some()))
    }

    /// The arena and the launch's token count, where an arena is installed and holds the launch
    /// (`x`'s first dim).
    fn arena_for(&self, x: &Tensor) -> Option<(&Arena, usize)> {
        let ar = self.arena.as_deref()?;
        Some((ar, arena::rows_within(ar.rows, x)?))
    }

    /// The core step on the arena: the same ops as [`LoopedModel::core_step`] in the same order,
    /// each writing into its buffer (`ops::into`). Returns the state in one of `normed`.
    fn core_step_in(&self, h: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore, ar: &Arena) -> Result<CoreOut> {
        let t = h.dim(0)?;
        let eps = self.cfg.rms_norm_eps;
        let (nh, nkv, hd) = (self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        let rows = |b: &Tensor| b.narrow(0, 0, t);
        let a = rows(ar.normed.next())?;
        let (res, mid, m, proj) = (rows(&ar.residual)?, rows(&ar.mid)?, rows(&ar.mid_normed)?, rows(&ar.proj)?);
        let (qkv, attn, gate_up, act) = (rows(&ar.qkv)?, rows(&ar.attn)?, rows(&ar.gate_up)?, rows(&ar.act)?);
        let attn_heads = attn.reshape((t, nh, hd))?;
        into::rms_norm_into(h, self.layers.first().map_or(&self.norm, |l| &l.input_norm), eps, &a)?;
        let n = self.layers.len();
        for (l, layer) in self.layers.iter().enumerate() {
            let next_norm = if l + 1 < n { &self.layers[l + 1].input_norm } else { &self.norm };
            // Layer 0 reads the step's input as its residual; later layers the stream.
            let residual = if l == 0 { h } else { &res };
            into::linear_into(&a, weight(&layer.qkv)?, &qkv)?;
            let scale = 1.0 / (hd as f64).sqrt();
            into::qkv_rope_attention_into(&qkv, &input.rope, kv.k(l), kv.v(l), batch, (nh, nkv, hd), scale, &ar.attention, &attn_heads)?;
            let norm = NormAfter::Sandwich { w_x: &layer.input_norm_2, w_next: &layer.post_attn_norm };
            into::linear_norm_into(residual, &attn, weight(&layer.o_proj)?, norm, eps, (&proj, &ar.parts), &mid, &m)?;
            into::linear_into(&m, weight(&layer.gate_up)?, &gate_up)?;
            into::silu_mul_into(&gate_up, &act)?;
            let norm = NormAfter::Sandwich { w_x: &layer.post_attn_norm_2, w_next: next_norm };
            into::linear_norm_into(&mid, &act, weight(&layer.down)?, norm, eps, (&proj, &ar.parts), &res, &a)?;
        }
        crate::ops::policy::count(|c| c.arena_steps += 1);
        let gate_logit = match (self.gate_on, self.gate.stored(), self.gate.bias()) {
            (false, ..) => None,
            (true, LinearWeight::Dense(w), Some(b)) => {
                let g = ar.gate.narrow(0, 0, t)?;
                into::gate_logit_into(&a, w, b, &g)?;
                Some(g)
            }
            (true, ..) => Some(self.gate.forward(&a.to_dtype(DType::F32)?)?.squeeze(1)?),
        };
        Ok(CoreOut { hidden: a, gate_logit })
    }
}

impl LoopedModel for Ouro {
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

    fn prelude(&self, ids: &Tensor, _input: &StageInput, _batch: &PagedBatch, _kv: &KvStore) -> Result<Tensor> {
        if let Some((ar, t)) = self.arena_for(ids) {
            let out = ar.embedded.narrow(0, 0, t)?;
            into::gather_rows_into(&self.embed, ids, &out)?;
            return Ok(out);
        }
        self.embed.index_select(ids, 0)
    }

    fn core_step(&self, h: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<CoreOut> {
        if let Some((arena, _)) = self.arena_for(h) {
            return self.core_step_in(h, input, batch, kv, arena);
        }
        // Each layer ends with one fused op: residual add + the next layer's input norm (the
        // final norm after the last layer), so only the first input norm runs on its own.
        let n = self.layers.len();
        let mut h = h.clone();
        let mut a = match self.layers.first() {
            Some(first) => ops::rms_norm(&h, &first.input_norm, self.cfg.rms_norm_eps)?,
            None => ops::rms_norm(&h, &self.norm, self.cfg.rms_norm_eps)?,
        };
        for l in 0..n {
            let next_norm = if l + 1 < n { &self.layers[l + 1].input_norm } else { &self.norm };
            (h, a) = self.layer_forward(l, &h, &a, next_norm, input, batch, kv)?;
        }
        let h = a;
        let gate_logit = if self.gate_on { Some(self.gate.forward(&h.to_dtype(DType::F32)?)?.squeeze(1)?) } else { None };
        Ok(CoreOut { hidden: h, gate_logit })
    }

    fn coda(&self, state: &Tensor, _input: &StageInput, _batch: &PagedBatch, _kv: &KvStore) -> Result<Tensor> {
        Ok(state.clone())
    }

    fn head_into(&self, h: &Tensor, out: &Tensor) -> Result<bool> {
        if self.arena.is_none() || self.tp.is_some() {
            return Ok(false);
        }
        into::linear_f32_into(h, &*self.lm_head.weight()?, out)?;
        Ok(true)
    }

    fn head(&self, h: &Tensor) -> Result<Tensor> {
        let logits = ops::linear_f32(h, &*self.lm_head.weight()?)?;
        match &self.tp {
            Some(tp) => tp.gather_vocab(&logits, self.spec.vocab_size),
            None => Ok(logits),
        }
    }

    fn replace_gate_head(&mut self, head: &crate::looped::gate::GateHead) -> crate::Result<()> {
        let h = self.spec.hidden_size;
        if head.rows != 1 || head.hidden != h {
            return Err(crate::Error::tensor("gate head", format!("[{}, {}], expected [1, {h}] for this model", head.rows, head.hidden)));
        }
        let dev = self.embed.device();
        let weight = Tensor::from_vec(head.weight.clone(), (1, h), dev)?;
        let bias = Tensor::from_vec(head.bias.clone(), 1, dev)?;
        self.gate = Linear::dense(weight, Some(bias));
        Ok(())
    }

    fn install_decode_arena(&mut self, rows: usize) -> crate::Result<bool> {
        if !self.has_arena_body() || rows == 0 {
            self.arena = None;
            return Ok(false);
        }
        let (h, i, dt, dev) = (self.spec.hidden_size, self.cfg.intermediate_size, self.spec.dtype, &self.device);
        let (nh, nkv, hd) = (self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        let buf = |cols: usize| Tensor::zeros((rows, cols), dt, dev);
        self.arena = Some(Arc::new(Arena {
            rows,
            normed: Turns::new([buf(h)?, buf(h)?]),
            residual: buf(h)?,
            mid: buf(h)?,
            mid_normed: buf(h)?,
            qkv: buf((nh + 2 * nkv) * hd)?,
            attn: buf(nh * hd)?,
            proj: buf(h)?,
            gate_up: buf(2 * i)?,
            act: buf(i)?,
            parts: arena::partials(rows, h, dev)?,
            attention: AttentionScratch::new(rows, nh, hd, dt, dev)?,
            rope: arena::rope_buffers(rows, hd, dt, dev)?,
            embedded: buf(h)?,
            gate: Tensor::zeros(rows, DType::F32, dev)?,
        }));
        Ok(true)
    }

    fn decode_arena_bytes(&self, rows: usize) -> u64 {
        if !self.has_arena_body() {
            return 0;
        }
        let (h, i, nh, nkv, hd) = (self.spec.hidden_size, self.cfg.intermediate_size, self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim);
        // normed ×2, residual, mid, mid_normed, proj, embedded; qkv, attn (and attention's q),
        // gate_up, act; RoPE.
        let cols = 7 * h + (nh + 2 * nkv) * hd + 2 * nh * hd + 3 * i + 2 * hd;
        let activations = (rows * cols * self.spec.dtype.size_in_bytes()) as u64;
        activations + arena::workspace_bytes(rows, h, nh, hd)
    }

    fn set_gate_logit(&mut self, on: bool) {
        self.gate_on = on;
    }

    fn prelude_head_table(&self, head: &crate::looped::gate::GateHead) -> crate::Result<Vec<f32>> {
        let h = self.spec.hidden_size;
        if head.hidden != h {
            return Err(crate::Error::tensor("preloop head", format!("[{}, {}], expected [T, {h}] for this model", head.rows, head.hidden)));
        }
        let dev = self.embed.device();
        let weight = Tensor::from_vec(head.weight.clone(), (head.rows, h), dev)?;
        let bias = Tensor::from_vec(head.bias.clone(), head.rows, dev)?;
        // The head reads the embedding in the model's dtype, as the served prelude output is; in
        // slices of the vocabulary, so no f32 copy of the whole table is made after the KV pool
        // has taken the device's memory.
        let vocab = self.embed.dim(0)?;
        let mut out = Vec::with_capacity(vocab * head.rows);
        for start in (0..vocab).step_by(8192) {
            let rows = self.embed.narrow(0, start, 8192.min(vocab - start))?.to_dtype(DType::F32)?;
            out.extend(rows.matmul(&weight.t()?)?.broadcast_add(&bias)?.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the engine counts against device memory for the arena covers what it allocates, and
    /// only a dense single-device model gets one.
    #[test]
    fn the_arena_is_counted_before_it_is_allocated() {
        let cfg = crate::testing::tiny_ouro_config(97);
        let weights = crate::testing::random_ouro_weights(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
        let mut ouro = Ouro::load(&cfg, &weights).unwrap();
        for rows in [1, 16, 64, 512] {
            assert!(ouro.install_decode_arena(rows).unwrap());
            let ar = ouro.arena.as_deref().unwrap();
            let mut tensors: Vec<&Tensor> = vec![&ar.residual, &ar.mid, &ar.mid_normed, &ar.qkv, &ar.attn, &ar.proj, &ar.gate_up, &ar.act, &ar.parts];
            tensors.extend(ar.normed.both().iter().chain([&ar.embedded, &ar.gate]));
            tensors.extend(ar.rope.both().iter().flat_map(|(c, s)| [c, s]));
            let allocated: u64 = tensors.into_iter().map(ops::bytes_of).sum();
            assert!(allocated <= ouro.decode_arena_bytes(rows), "{rows} rows: {allocated} bytes allocated, {} counted", ouro.decode_arena_bytes(rows));
        }
        assert!(!ouro.install_decode_arena(0).unwrap() && ouro.arena.is_none(), "no arena of zero rows");
    }

    /// A launch wider than the arena runs the plain body; one within it, the arena's, with the
    /// same state; consecutive steps alternate the output buffer, so a step can read the last.
    #[test]
    fn steps_within_the_arena_alternate_their_output() {
        let cfg = crate::testing::tiny_ouro_config(97);
        let weights = crate::testing::random_ouro_weights(&cfg, 4, DType::F32, &Device::Cpu).unwrap();
        let plain = Ouro::load(&cfg, &weights).unwrap();
        let mut arena = plain.clone();
        assert!(arena.install_decode_arena(4).unwrap());
        let kv = KvStore::new(cfg.num_hidden_layers, 8, 4, cfg.kv_heads(), cfg.head_dim(), DType::F32, &Device::Cpu).unwrap();
        let kv2 = KvStore::new(cfg.num_hidden_layers, 8, 4, cfg.kv_heads(), cfg.head_dim(), DType::F32, &Device::Cpu).unwrap();
        let mut host = ops::PagedBatchHost::new();
        for r in 0..3u32 {
            host.push_row(&[r], 1, 1, None);
        }
        let width = cfg.kv_heads() * cfg.head_dim();
        let batch = PagedBatch::new(host, 4, ops::AttnMask::Causal, width, &Device::Cpu).unwrap();
        let positions = Tensor::new(&[0u32, 0, 0], &Device::Cpu).unwrap();
        let ids = Tensor::new(&[5u32, 9, 11], &Device::Cpu).unwrap();
        let (input_p, input_a) = (plain.prepare(&positions).unwrap(), arena.prepare(&positions).unwrap());
        let mut hp = plain.prelude(&ids, &input_p, &batch, &kv).unwrap();
        let mut ha = arena.prelude(&ids, &input_a, &batch, &kv2).unwrap();
        let (mut outputs, mut values) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            hp = plain.core_step(&hp, &input_p, &batch, &kv).unwrap().hidden;
            ha = arena.core_step(&ha, &input_a, &batch, &kv2).unwrap().hidden;
            assert_eq!(hp.to_vec2::<f32>().unwrap(), ha.to_vec2::<f32>().unwrap());
            outputs.push(ha.clone());
            values.push(ha.to_vec2::<f32>().unwrap());
        }
        // The first step's output buffer now holds the third step's state; the second's its own.
        assert_ne!(values[0], values[2]);
        assert_eq!(outputs[0].to_vec2::<f32>().unwrap(), values[2]);
        assert_eq!(outputs[1].to_vec2::<f32>().unwrap(), values[1]);
        // Five rows do not fit an arena of four: a fresh tensor, the plain body's.
        let five = Tensor::zeros((5, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
        assert!(arena.arena_for(&five).is_none());
    }
}
