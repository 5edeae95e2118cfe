//! The pre-norm transformer every diffusion family loads into: RMSNorm (f32 statistics),
//! split-half RoPE, GQA, SwiGLU MLP — dense, or mixture-of-experts after the first layers
//! (LLaDA2.0, [`super::moe`]). Families differ only in tensor names ([`Naming`]) and a few
//! switches ([`DenseArch`]): per-head q/k RMSNorm (SDAR, LLaDA2.0), q/k/v biases (Dream), a fused
//! QKV tensor and partial RoPE (LLaDA2.0), the attention pattern and whether logits are shifted.

use super::moe::{Expert, Moe, RouterArch};
use super::{DiffusionAttention, DiffusionModel, DiffusionSpec, Projected};
use crate::kv::KvStore;
use crate::loader::Weights;
use crate::ops::moe::{RouterWeights, StackedExperts};
use crate::ops::Linear;
use crate::ops::{self, paged_attention, PagedBatch, RopeAngles, RopeTable};
use candle_core::{DType, Device, Result, Tensor};

/// A checkpoint's tensor names. Layer tensors are `{layers}.{l}.{name}.weight` (and `.bias`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Naming {
    pub embed: &'static str,
    pub final_norm: &'static str,
    pub lm_head: &'static str,
    pub layers: &'static str,
    pub attn_norm: &'static str,
    /// One fused `[q; k; v]` tensor (all q heads, then k, then v) instead of `q`, `k`, `v`.
    pub qkv: Option<&'static str>,
    pub q: &'static str,
    pub k: &'static str,
    pub v: &'static str,
    pub o: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    pub mlp_norm: &'static str,
    /// The SiLU branch of the SwiGLU.
    pub gate: &'static str,
    /// The linear branch.
    pub up: &'static str,
    pub down: &'static str,
}

impl Naming {
    /// Qwen2 / Qwen3 names (SDAR, Dream).
    pub const QWEN: Naming = Naming {
        embed: "model.embed_tokens.weight",
        final_norm: "model.norm.weight",
        lm_head: "lm_head.weight",
        layers: "model.layers",
        attn_norm: "input_layernorm",
        qkv: None,
        q: "self_attn.q_proj",
        k: "self_attn.k_proj",
        v: "self_attn.v_proj",
        o: "self_attn.o_proj",
        q_norm: "self_attn.q_norm",
        k_norm: "self_attn.k_norm",
        mlp_norm: "post_attention_layernorm",
        gate: "mlp.gate_proj",
        up: "mlp.up_proj",
        down: "mlp.down_proj",
    };

    /// LLaDA's OLMo-derived names (`ff_proj` is the gate, `ff_out` the down projection, and the
    /// model-level `ff_out` the LM head).
    pub const LLADA: Naming = Naming {
        embed: "model.transformer.wte.weight",
        final_norm: "model.transformer.ln_f.weight",
        lm_head: "model.transformer.ff_out.weight",
        layers: "model.transformer.blocks",
        attn_norm: "attn_norm",
        qkv: None,
        q: "q_proj",
        k: "k_proj",
        v: "v_proj",
        o: "attn_out",
        q_norm: "q_norm",
        k_norm: "k_norm",
        mlp_norm: "ff_norm",
        gate: "ff_proj",
        up: "up_proj",
        down: "ff_out",
    };

    /// LLaDA2.0's Ling-2.0 names (fused `query_key_value`, `dense` output projection); its MoE
    /// layers' router, experts and shared experts are under `mlp.gate`, `mlp.experts.{e}` and
    /// `mlp.shared_experts`.
    pub const LLADA2: Naming = Naming {
        embed: "model.word_embeddings.weight",
        final_norm: "model.norm.weight",
        lm_head: "lm_head.weight",
        layers: "model.layers",
        attn_norm: "input_layernorm",
        qkv: Some("attention.query_key_value"),
        q: "",
        k: "",
        v: "",
        o: "attention.dense",
        q_norm: "attention.query_layernorm",
        k_norm: "attention.key_layernorm",
        mlp_norm: "post_attention_layernorm",
        gate: "mlp.gate_proj",
        up: "mlp.up_proj",
        down: "mlp.down_proj",
    };

    /// `{layers}.{l}.{name}.{kind}`.
    pub fn layer(&self, l: usize, name: &str, kind: &str) -> String {
        format!("{}.{l}.{name}.{kind}", self.layers)
    }
}

/// Everything [`DenseDiffusion::load`] needs to know, filled by each family from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseArch {
    pub naming: Naming,
    pub model_type: String,
    /// Ids the sampler may produce; logits are cut to this width.
    pub vocab_size: usize,
    /// Rows of the embedding and LM head (≥ `vocab_size` when the table is padded).
    pub table_rows: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates (split-half within them); `head_dim` for all.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    /// Per-head RMSNorm of q and k (weight `[head_dim]`) before RoPE.
    pub qk_norm: bool,
    pub qkv_bias: bool,
    /// Use the embedding as LM head when the checkpoint has no separate one.
    pub tie_embeddings: bool,
    pub attention: DiffusionAttention,
    pub shift_logits: bool,
    pub mask_token_id: u32,
    pub block_length: Option<usize>,
    /// The released decoding's confidence threshold, when it is not the engine's 0.9.
    pub unmask_threshold: Option<f32>,
    /// How the family's own `generate` samples a step's tokens at temperature > 0.
    pub sampler: crate::diffusion::DiffusionSampler,
    pub max_context: usize,
    /// Mixture-of-experts MLPs in the layers `moe_layers` marks (Qwen3-MoE / Ling-2.0 names:
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts`).
    pub moe: Option<MoeArch>,
}

/// A [`DenseArch`] from a config that names its dimensions as the Qwen-style configs do
/// (`vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
/// `num_attention_heads`, `kv_heads()`, `head_dim()`, `rope_theta`, `rms_norm_eps`,
/// `tie_word_embeddings`, `mask_token_id()`, `max_position_embeddings`), with the family's own
/// fields after it.
macro_rules! qwen_named_arch {
    ($cfg:expr, { $($field:ident : $value:expr),* $(,)? }) => {{
        let cfg = $cfg;
        $crate::diffusion::models::DenseArch {
            vocab_size: cfg.vocab_size,
            table_rows: cfg.vocab_size,
            hidden_size: cfg.hidden_size,
            intermediate_size: cfg.intermediate_size,
            num_layers: cfg.num_hidden_layers,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            rope_theta: cfg.rope_theta,
            rms_norm_eps: cfg.rms_norm_eps,
            tie_embeddings: cfg.tie_word_embeddings,
            mask_token_id: cfg.mask_token_id(),
            max_context: cfg.max_position_embeddings,
            $($field: $value),*
        }
    }};
}
pub(crate) use qwen_named_arch;

/// The MoE part of a [`DenseArch`].
#[derive(Debug, Clone, PartialEq)]
pub struct MoeArch {
    pub router: RouterArch,
    /// Per layer: whether its MLP is MoE (else the dense `intermediate_size` SwiGLU).
    pub moe_layers: Vec<bool>,
    /// Each routed expert's SwiGLU width.
    pub expert_width: usize,
    /// Shared experts (added with weight 1), stored as one SwiGLU of `shared × expert_width`.
    pub shared_experts: usize,
    /// LLaDA2.0's `mlp.gate.expert_bias` (selection only).
    pub expert_bias: bool,
}

#[derive(Debug, Clone)]
enum Mlp {
    Dense(Expert),
    Moe(Box<Moe>),
}

impl Layer {
    fn bytes(&self) -> u64 {
        let mlp = match &self.mlp {
            Mlp::Dense(e) => e.gate_up.bytes() + e.down.bytes(),
            Mlp::Moe(m) => {
                m.router.bytes()
                    + m.bias.as_ref().map_or(0, ops::bytes_of)
                    + m.experts.bytes()
                    + m.shared.as_ref().map_or(0, |s| s.gate_up.bytes() + s.down.bytes())
            }
        };
        ops::bytes_of(&self.attn_norm)
            + self.qkv.bytes()
            + self.qk_norm.as_ref().map_or(0, |(q, k)| ops::bytes_of(q) + ops::bytes_of(k))
            + self.o.bytes()
            + ops::bytes_of(&self.mlp_norm)
            + mlp
    }
}

impl Mlp {
    /// `h + mlp(x)`: the block's second residual add (fused into the MoE combine); a
    /// tensor-parallel rank sums its columns' partial output over the ranks first.
    fn forward_residual(&self, h: &Tensor, x: &Tensor, tp: Option<&crate::parallel::TpShard>) -> Result<Tensor> {
        match self {
            Self::Dense(e) => match tp {
                Some(tp) => ops::residual_add(h, &tp.sum(&e.forward(x)?)?),
                None => ops::residual_add(h, &e.forward(x)?),
            },
            Self::Moe(m) => m.forward_residual(h, x, tp),
        }
    }
}

/// Partial RoPE as full-width split-half RoPE: each head's q/k dims are permuted at load time so
/// that the rotated pairs (j, j + r/2), j < r/2, sit at (j, j + d/2) and the unrotated dims fill
/// the other pairs, whose frequency is zero. Scores are sums over dims, so the same permutation of
/// q and k leaves attention unchanged. `perm[new] = old`.
fn rotary_permutation(d: usize, r: usize) -> Vec<usize> {
    let (half, rh) = (d / 2, r / 2);
    let mut perm = vec![0; d];
    for j in 0..half {
        if j < rh {
            perm[j] = j;
            perm[j + half] = j + rh;
        } else {
            perm[j] = r + (j - rh);
            perm[j + half] = r + (half - rh) + (j - rh);
        }
    }
    perm
}

#[derive(Debug, Clone)]
struct Layer {
    attn_norm: Tensor,
    /// q, k, v stacked on the output dim: one matmul instead of three.
    qkv: Linear,
    qk_norm: Option<(Tensor, Tensor)>,
    o: Linear,
    mlp_norm: Tensor,
    mlp: Mlp,
}

/// A loaded dense diffusion LM. Weights only; cloning shares the weight tensors.
#[derive(Debug, Clone)]
pub struct DenseDiffusion {
    arch: DenseArch,
    spec: DiffusionSpec,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    rope: RopeTable,
    device: Device,
    /// A tensor-parallel rank holds its heads and MLP columns of every layer.
    tp: Option<crate::parallel::TpShard>,
}

impl DenseDiffusion {
    pub fn load(arch: &DenseArch, w: &Weights) -> crate::Result<Self> {
        Self::load_with(arch, w, None, false)
    }

    /// Rank `rank` of a tensor-parallel dense model (as `Ouro::load_shard`): every layer's q, k
    /// and v heads (with their biases), MLP columns and rows of the head (vocabulary-parallel, the
    /// logits gathered); the embedding and norms whole.
    /// Mixture-of-experts layers are refused (expert parallelism is to come).
    pub fn load_shard(
        arch: &DenseArch,
        w: &Weights,
        rank: crate::parallel::TpRank,
        comm: std::sync::Arc<dyn crate::parallel::Communicator>,
    ) -> crate::Result<Self> {
        Self::load_with(arch, w, Some(crate::parallel::TpShard::new(rank, comm)?), false)
    }

    /// Like [`DenseDiffusion::load_shard`], with the routed experts of MoE layers split over
    /// the ranks whole (expert parallelism: rank r holds experts `r·E/n .. (r+1)·E/n`, and
    /// computes only the routes to them) instead of every expert's columns.
    pub fn load_expert_shard(
        arch: &DenseArch,
        w: &Weights,
        rank: crate::parallel::TpRank,
        comm: std::sync::Arc<dyn crate::parallel::Communicator>,
    ) -> crate::Result<Self> {
        Self::load_with(arch, w, Some(crate::parallel::TpShard::new(rank, comm)?), true)
    }

    fn load_with(arch: &DenseArch, w: &Weights, tp: Option<crate::parallel::TpShard>, expert_parallel: bool) -> crate::Result<Self> {
        let a = arch;
        let n = &a.naming;
        let (h, i, rows) = (a.hidden_size, a.intermediate_size, a.table_rows);
        let (nh, nkv, hd) = (a.num_heads, a.num_kv_heads, a.head_dim);
        w.check_layer_count(n.layers, a.num_layers, "num_hidden_layers")?;
        if a.rotary_dim == 0 || a.rotary_dim > hd || a.rotary_dim % 2 != 0 {
            return Err(crate::Error::InvalidOption(format!("rotary width {} must be even and in 1..={hd}", a.rotary_dim)));
        }
        let perm = (a.rotary_dim < hd).then(|| rotary_permutation(hd, a.rotary_dim));
        if perm.is_some() && a.qkv_bias {
            return Err(crate::Error::InvalidOption("partial RoPE with q/k/v biases is not supported".into()));
        }
        if let Some(m) = &a.moe {
            m.router.validate()?;
            if m.moe_layers.len() != a.num_layers {
                return Err(crate::Error::InvalidOption(format!("{} MoE layer flags for {} layers", m.moe_layers.len(), a.num_layers)));
            }
        }
        let mut layers = Vec::with_capacity(a.num_layers);
        for l in 0..a.num_layers {
            let wt = |name: &str, shape: (usize, usize)| w.get_dense(shape, &n.layer(l, name, "weight"));
            let part = |name: &str, shape: (usize, usize)| (n.layer(l, name, "weight"), shape);
            let vec = |name: &str, kind: &str, len: usize| w.get(len, &n.layer(l, name, kind));
            let qkv_b =
                if a.qkv_bias { Some(Tensor::cat(&[vec(n.q, "bias", nh * hd)?, vec(n.k, "bias", nkv * hd)?, vec(n.v, "bias", nkv * hd)?], 0)?) } else { None };
            let mut qkv = match n.qkv {
                Some(fused) => w.linear_cat(&[part(fused, ((nh + 2 * nkv) * hd, h))], qkv_b)?,
                None => w.linear_cat(&[part(n.q, (nh * hd, h)), part(n.k, (nkv * hd, h)), part(n.v, (nkv * hd, h))], qkv_b)?,
            };
            let mut qk_norm = if a.qk_norm { Some((vec(n.q_norm, "weight", hd)?, vec(n.k_norm, "weight", hd)?)) } else { None };
            if let Some(perm) = &perm {
                // Every q and k head's rows (not v's), and the per-head norm weights, in the
                // permuted order.
                let idx: Vec<u32> =
                    (0..nh + 2 * nkv).flat_map(|head| (0..hd).map(move |d| (head * hd + if head < nh + nkv { perm[d] } else { d }) as u32)).collect();
                qkv = qkv.select_rows(&idx)?;
                let p = Tensor::from_vec(perm.iter().map(|&x| x as u32).collect::<Vec<_>>(), hd, w.device())?;
                qk_norm = qk_norm.map(|(q, k)| Ok::<_, candle_core::Error>((q.index_select(&p, 0)?, k.index_select(&p, 0)?))).transpose()?;
            }
            let mut o = w.linear_cat(&[part(n.o, (h, nh * hd))], None)?;
            if let Some(tp) = &tp {
                // Whole heads (a head's rows stay together under the rotary permutation).
                (qkv, o) = tp.rank.attention(&qkv, &o, nh, nkv, hd)?;
            }
            let swiglu = |gate: &str, up: &str, down: &str, width: usize| -> crate::Result<Expert> {
                let (mut gate_up, mut down) =
                    (w.linear_cat(&[part(gate, (width, h)), part(up, (width, h))], None)?, w.linear_cat(&[part(down, (h, width))], None)?);
                if let Some(tp) = &tp {
                    (gate_up, down) = tp.rank.mlp(&gate_up, &down, width)?;
                }
                Ok(Expert { gate_up, down })
            };
            let mlp = match &a.moe {
                Some(m) if m.moe_layers.get(l) == Some(&true) => {
                    let e = m.router.num_experts;
                    // The router runs in f32 from the stored values (a bf16 cast first would blur the
                    // selection-only bias, whose steps are the size of the gaps between scores).
                    let router = RouterWeights::new(w.get_as((e, h), &n.layer(l, "mlp.gate", "weight"), DType::F32)?)?;
                    let bias = if m.expert_bias { Some(w.get_as(e, &n.layer(l, "mlp.gate", "expert_bias"), DType::F32)?) } else { None };
                    let ew = m.expert_width;
                    // A rank's experts (expert parallelism) or its columns of every expert.
                    let (held, columns) = match &tp {
                        Some(tp) if expert_parallel => (tp.rank.share(e, 1, "routed experts")?, 0..ew),
                        Some(tp) => (0..e, tp.rank.share(ew, 1, "expert columns")?),
                        None => (0..e, 0..ew),
                    };
                    let (mut gate_ups, mut downs) = (Vec::with_capacity(held.len()), Vec::with_capacity(held.len()));
                    let cols = columns.len();
                    for x in held.clone() {
                        let p = format!("mlp.experts.{x}");
                        let (gate, up) = (wt(&format!("{p}.gate_proj"), (ew, h))?, wt(&format!("{p}.up_proj"), (ew, h))?);
                        gate_ups.push(Tensor::cat(&[gate.narrow(0, columns.start, cols)?, up.narrow(0, columns.start, cols)?], 0)?);
                        downs.push(wt(&format!("{p}.down_proj"), (h, ew))?.narrow(1, columns.start, cols)?.contiguous()?);
                    }
                    let experts = StackedExperts::quantized(Tensor::stack(&gate_ups, 0)?, Tensor::stack(&downs, 0)?, w.quantization())?;
                    let first_expert = (tp.is_some() && expert_parallel).then_some(held.start as u32);
                    let shared = (m.shared_experts > 0)
                        .then(|| {
                            swiglu(
                                "mlp.shared_experts.gate_proj",
                                "mlp.shared_experts.up_proj",
                                "mlp.shared_experts.down_proj",
                                m.expert_width * m.shared_experts,
                            )
                        })
                        .transpose()?;
                    Mlp::Moe(Box::new(Moe { arch: m.router.clone(), router, bias, experts, shared, first_expert }))
                }
                _ => Mlp::Dense(swiglu(n.gate, n.up, n.down, i)?),
            };
            layers.push(Layer { attn_norm: vec(n.attn_norm, "weight", h)?, qkv, qk_norm, o, mlp_norm: vec(n.mlp_norm, "weight", h)?, mlp });
        }
        let embed = w.get((rows, h), n.embed)?;
        let lm_head = if a.tie_embeddings && !w.contains(n.lm_head) { embed.clone() } else { w.get((rows, h), n.lm_head)? };
        // A tensor-parallel rank holds its share of the head's rows (vocabulary-parallel).
        let lm_head = match &tp {
            Some(t) => t.rank.vocab_share(&lm_head)?,
            None => lm_head,
        };
        let attention = (nh + 2 * nkv) * hd * h // q, k, v
            + h * nh * hd // o
            + 2 * h // the two norms
            + if a.qk_norm { 2 * hd } else { 0 }
            + if a.qkv_bias { (nh + 2 * nkv) * hd } else { 0 };
        // What one token touches: its experts, the shared ones and the router in MoE layers.
        let layer_params: usize = (0..a.num_layers)
            .map(|l| match &a.moe {
                Some(m) if m.moe_layers.get(l) == Some(&true) => {
                    attention + m.router.num_experts * h + 3 * h * m.expert_width * (m.router.top_k + m.shared_experts)
                }
                _ => attention + 3 * h * i,
            })
            .sum();
        let norm = w.get(h, n.final_norm)?;
        let tied = a.tie_embeddings && !w.contains(n.lm_head);
        let weight_bytes =
            layers.iter().map(Layer::bytes).sum::<u64>() + ops::bytes_of(&embed) + if tied { 0 } else { ops::bytes_of(&lm_head) } + ops::bytes_of(&norm);
        // A rank attends with its own heads.
        let ranks = tp.as_ref().map_or(1, |t| t.rank.world);
        let spec = DiffusionSpec {
            model_type: a.model_type.clone(),
            vocab_size: a.vocab_size,
            hidden_size: h,
            num_layers: a.num_layers,
            num_heads: nh / ranks,
            num_kv_heads: tp.as_ref().map_or(nkv, |t| t.rank.kv_heads_per_rank(nkv)),
            head_dim: hd,
            mask_token_id: a.mask_token_id,
            attention: a.attention,
            shift_logits: a.shift_logits,
            block_length: a.block_length,
            unmask_threshold: a.unmask_threshold,
            sampler: a.sampler,
            max_context: a.max_context,
            layer_params: layer_params as u64,
            // What the head's matmul touches per token read (padding rows included).
            head_params: (rows * h) as u64,
            dtype: w.dtype(),
            weight_bytes,
        };
        Ok(Self {
            rope: RopeTable::partial(hd, a.rotary_dim, a.rope_theta, w.dtype(), w.device())?,
            norm,
            lm_head: Linear::dense(lm_head, None),
            embed,
            layers,
            spec,
            arch: a.clone(),
            device: w.device().clone(),
            tp,
        })
    }

    pub fn arch(&self) -> &DenseArch {
        &self.arch
    }

    /// The experts layer `l`'s router chooses for each token of its MLP input `x`
    /// `[tokens, hidden]` (the post-attention-norm stream), best first; `None` for a dense layer.
    pub fn routed_experts(&self, l: usize, x: &Tensor) -> Result<Option<Vec<Vec<usize>>>> {
        match self.layers.get(l).map(|layer| &layer.mlp) {
            Some(Mlp::Moe(m)) => Ok(Some(m.routes(x)?.into_iter().map(|r| r.into_iter().map(|e| e as usize).collect()).collect())),
            _ => Ok(None),
        }
    }
}

impl DiffusionModel for DenseDiffusion {
    fn spec(&self) -> &DiffusionSpec {
        &self.spec
    }

    fn sum_over_ranks(&self, t: &Tensor) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => tp.sum(t),
            None => Ok(t.clone()),
        }
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        self.embed.index_select(ids, 0)
    }

    fn rope(&self, positions: &Tensor) -> Result<RopeAngles> {
        self.rope.angles(positions)
    }

    fn project(&self, l: usize, h: &Tensor, rope: &RopeAngles) -> Result<Projected> {
        let layer = &self.layers[l];
        let s = &self.spec;
        let eps = self.arch.rms_norm_eps;
        let qkv = layer.qkv.forward(&ops::rms_norm(h, &layer.attn_norm, eps)?)?;
        let norm = layer.qk_norm.as_ref().map(|(q, k)| (q, k));
        let (q, k, v) = ops::qkv_norm_rope(&qkv, norm, eps, rope, s.num_heads, s.num_kv_heads, s.head_dim)?;
        Ok(Projected { q, k, v })
    }

    /// The split, q/k norm, RoPE and K/V write as one fused op (one launch on CUDA).
    fn project_write(&self, l: usize, h: &Tensor, rope: &RopeAngles, batch: &PagedBatch, kv: &KvStore) -> Result<Projected> {
        let layer = &self.layers[l];
        let s = &self.spec;
        let qkv = layer.qkv.forward(&ops::rms_norm(h, &layer.attn_norm, self.arch.rms_norm_eps)?)?;
        let norm = layer.qk_norm.as_ref().map(|(q, k)| (q, k));
        let (q, k, v) = ops::qkv_norm_rope_write(&qkv, norm, self.arch.rms_norm_eps, rope, kv.k(l), kv.v(l), batch, s.num_heads, s.num_kv_heads, s.head_dim)?;
        Ok(Projected { q, k, v })
    }

    fn finish_layer(&self, l: usize, h: &Tensor, q: &Tensor, batch: &PagedBatch, kv: &KvStore) -> Result<Tensor> {
        let layer = &self.layers[l];
        let (nh, hd) = (self.spec.num_heads, self.spec.head_dim);
        let t = h.dim(0)?;
        let attn = paged_attention(q, kv.k(l), kv.v(l), batch, 1.0 / (hd as f64).sqrt())?;
        let o = layer.o.forward(&attn.reshape((t, nh * hd))?)?;
        // A tensor-parallel rank's heads and columns give partial outputs; their sum is the layer's.
        let o = match &self.tp {
            Some(tp) => tp.sum(&o)?,
            None => o,
        };
        let (h, m) = ops::residual_add_rms_norm(h, &o, &layer.mlp_norm, self.arch.rms_norm_eps)?;
        layer.mlp.forward_residual(&h, &m, self.tp.as_ref())
    }

    fn head(&self, h: &Tensor) -> Result<Tensor> {
        self.head_native(h)?.to_dtype(DType::F32)
    }

    fn head_native(&self, h: &Tensor) -> Result<Tensor> {
        let logits = self.lm_head.forward(&ops::rms_norm(h, &self.norm, self.arch.rms_norm_eps)?)?;
        if let Some(tp) = &self.tp {
            return tp.gather_vocab(&logits, self.arch.vocab_size);
        }
        if self.arch.table_rows > self.arch.vocab_size {
            return logits.narrow(1, 0, self.arch.vocab_size)?.contiguous();
        }
        Ok(logits)
    }
}
