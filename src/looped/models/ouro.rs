//! Ouro (ByteDance, arXiv 2510.25741): a Llama-style decoder whose L layers are applied
//! `total_ut_steps` times. Sandwich norm (4 RMSNorms per layer), split-half RoPE, the final
//! norm after every loop, a per-step exit-gate logit and an untied LM head.
//!
//! Stages: prelude = embedding lookup; core step = all L layers + norm + gate; coda = LM head.

use super::{CoreOut, LoopedModel, LoopedSpec, StageInput};
use crate::kv::KvStore;
use crate::loader::Weights;
use crate::looped::models::OuroConfig;
use crate::ops::Linear;
use crate::ops::{self, PagedBatch, RopeTable};
use crate::parallel::TpShard;
use candle_core::{DType, Device, Result, Tensor};

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

impl LoopedModel for Ouro {
    fn spec(&self) -> &LoopedSpec {
        &self.spec
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn prepare(&self, positions: &Tensor) -> Result<StageInput> {
        Ok(StageInput { rope: self.rope.angles(positions)?, positions: positions.clone() })
    }

    fn prelude(&self, ids: &Tensor, _input: &StageInput, _batch: &PagedBatch, _kv: &KvStore) -> Result<Tensor> {
        self.embed.index_select(ids, 0)
    }

    fn core_step(&self, h: &Tensor, input: &StageInput, batch: &PagedBatch, kv: &KvStore) -> Result<CoreOut> {
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
