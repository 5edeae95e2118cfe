//! `config.json` of the masked-diffusion families: SDAR (Qwen3 keys), LLaDA (OLMo-style keys)
//! and Dream (Qwen2 keys). Field names as in the released checkpoints.

use crate::config::{check_bounds, check_context, check_shapes, default_eps, default_theta, EosIds, MAX_CONTEXT, MAX_DIM, MAX_EXPERTS};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Without its mask token a masked-diffusion model cannot start decoding at all.
fn check_mask(path: &str, mask: u32, vocab: usize) -> Result<()> {
    if mask as usize >= vocab {
        return Err(Error::config(path, format!("mask token id {mask} is missing from the vocabulary of {vocab} (set `mask_token_id`)")));
    }
    Ok(())
}

fn check_norm(path: &str, eps: f64, theta: f64) -> Result<()> {
    if !(eps > 0.0) || !(theta > 0.0) {
        return Err(Error::config(path, "rms_norm_eps and rope_theta must be > 0"));
    }
    Ok(())
}

fn check_act(path: &str, act: &Option<String>) -> Result<()> {
    match act.as_deref() {
        None | Some("silu") => Ok(()),
        Some(other) => Err(Error::config(path, format!("hidden_act `{other}` is not supported (only silu)"))),
    }
}

/// Head width when the config gives none: hidden / heads, which must divide exactly.
fn derived_head_dim(path: &str, explicit: Option<usize>, hidden: usize, heads: usize) -> Result<usize> {
    match explicit {
        Some(d) => Ok(d),
        None if heads > 0 && hidden % heads == 0 => Ok(hidden / heads),
        None => Err(Error::config(path, format!("hidden size {hidden} is not a multiple of {heads} heads"))),
    }
}

/// SDAR (JetLM/SDAR-*, `model_type = "sdar"`): Qwen3 layout, block-causal attention.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct SdarConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_sdar_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Must be false (the released SDAR models have no attention biases).
    #[serde(default)]
    pub attention_bias: bool,
    /// The block length the checkpoint was trained with (`b<N>` in the model name).
    #[serde(default)]
    pub block_size: Option<usize>,
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    /// The MLP activation; only SwiGLU's `silu` is implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosIds>,
    /// Qwen3-MoE layers (the SDAR MoE checkpoints, `sdar_moe`): routed experts per MoE layer;
    /// absent for the dense models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    /// Renormalise the chosen experts' softmax scores (Qwen3-MoE's switch).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is MoE (counting from 1) unless listed in
    /// `mlp_only_layers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default = "default_sdar_type")]
    pub model_type: String,
}

fn default_sdar_max_pos() -> usize {
    32768
}
fn default_sdar_type() -> String {
    "sdar".into()
}

impl SdarConfig {
    /// SDAR's mask token (`<|MASK|>`), hard-coded by LMDeploy and SGLang when the config has none.
    pub const DEFAULT_MASK: u32 = 151669;

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    /// Qwen3 names `head_dim` explicitly; heads × head_dim need not equal the hidden size.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }
    pub fn mask_token_id(&self) -> u32 {
        self.mask_token_id.unwrap_or(Self::DEFAULT_MASK)
    }
    /// Per layer: whether its MLP is a Qwen3-MoE layer (all false for the dense models).
    pub fn moe_layers(&self) -> Vec<bool> {
        let step = self.decoder_sparse_step.unwrap_or(1).max(1);
        let moe = self.num_experts.unwrap_or(0) > 0;
        (0..self.num_hidden_layers).map(|l| moe && !self.mlp_only_layers.contains(&l) && (l + 1) % step == 0).collect()
    }

    pub(crate) fn validate(&self, path: &str) -> Result<()> {
        let hd = derived_head_dim(path, self.head_dim, self.hidden_size, self.num_attention_heads)?;
        check_shapes(path, self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.num_attention_heads, self.kv_heads(), hd)?;
        check_bounds(
            path,
            &[
                ("num_experts", self.num_experts.unwrap_or(0), MAX_EXPERTS),
                ("num_experts_per_tok", self.num_experts_per_tok.unwrap_or(0), MAX_EXPERTS),
                ("moe_intermediate_size", self.moe_intermediate_size.unwrap_or(0), MAX_DIM),
                ("block_size", self.block_size.unwrap_or(0), MAX_CONTEXT),
            ],
        )?;
        check_context(path, "max_position_embeddings", self.max_position_embeddings)?;
        if self.num_experts.unwrap_or(0) > 0 {
            if let Some(reason) = crate::diffusion::models::Sdar::router(self).shape_error() {
                return Err(Error::config(path, reason));
            }
            if self.moe_intermediate_size.unwrap_or(0) == 0 || self.decoder_sparse_step == Some(0) {
                return Err(Error::config(path, "MoE layers need a moe_intermediate_size and a sparse step > 0"));
            }
        }
        check_norm(path, self.rms_norm_eps, self.rope_theta)?;
        if self.attention_bias {
            return Err(Error::config(path, "attention_bias = true is not supported for SDAR"));
        }
        if self.rope_scaling.is_some() {
            return Err(Error::config(path, "rope_scaling is not supported"));
        }
        check_act(path, &self.hidden_act)?;
        if self.block_size == Some(0) {
            return Err(Error::config(path, "block_size must be > 0"));
        }
        check_mask(path, self.mask_token_id(), self.vocab_size)
    }

    /// JetLM/SDAR-8B-Chat-b32 (shapes only; GPU benchmarks).
    pub fn sdar_8b_chat_b32() -> Self {
        Self {
            vocab_size: 151936,
            hidden_size: 4096,
            intermediate_size: 12288,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: Some(8),
            head_dim: Some(128),
            max_position_embeddings: 32768,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            attention_bias: false,
            block_size: Some(32),
            mask_token_id: Some(Self::DEFAULT_MASK),
            rope_scaling: None,
            hidden_act: Some("silu".into()),
            bos_token_id: Some(151643),
            eos_token_id: Some(EosIds::One(151643)),
            num_experts: None,
            num_experts_per_tok: None,
            moe_intermediate_size: None,
            norm_topk_prob: false,
            decoder_sparse_step: None,
            mlp_only_layers: Vec::new(),
            model_type: "sdar".into(),
        }
    }
}

/// LLaDA-8B (GSAI-ML/LLaDA-8B-*, `model_type = "llada"`): OLMo-style keys, Llama blocks,
/// bidirectional attention. Keys that select architecture variants are read only to reject
/// the ones not implemented.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct LladaConfig {
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    #[serde(default)]
    pub n_kv_heads: Option<usize>,
    pub mlp_hidden_size: usize,
    pub vocab_size: usize,
    /// Rows of the embedding and output matrix (≥ vocab_size; padding rows are never sampled).
    #[serde(default)]
    pub embedding_size: Option<usize>,
    #[serde(default = "default_llada_max_seq")]
    pub max_sequence_length: usize,
    #[serde(default = "default_llada_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_llada_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub weight_tying: bool,
    #[serde(default)]
    pub include_bias: bool,
    #[serde(default)]
    pub include_qkv_bias: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_norm_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alibi: Option<bool>,
    /// OLMo's q/k LayerNorm; LLaDA has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_layer_norm: Option<bool>,
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosIds>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default = "default_llada_type")]
    pub model_type: String,
}

fn default_llada_max_seq() -> usize {
    4096
}
fn default_llada_theta() -> f64 {
    500_000.0
}
fn default_llada_eps() -> f64 {
    1e-5
}
fn default_llada_type() -> String {
    "llada".into()
}

impl LladaConfig {
    /// `<|mdm_mask|>` of the LLaDA tokenizer (hard-coded by LLaDA's `generate.py`).
    pub const DEFAULT_MASK: u32 = 126336;

    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }
    pub fn table_rows(&self) -> usize {
        self.embedding_size.unwrap_or(self.vocab_size).max(self.vocab_size)
    }
    pub fn mask_token_id(&self) -> u32 {
        self.mask_token_id.unwrap_or(Self::DEFAULT_MASK)
    }

    pub(crate) fn validate(&self, path: &str) -> Result<()> {
        let hd = derived_head_dim(path, None, self.d_model, self.n_heads)?;
        check_shapes(path, self.vocab_size, self.d_model, self.mlp_hidden_size, self.n_layers, self.n_heads, self.kv_heads(), hd)?;
        check_bounds(path, &[("embedding_size", self.embedding_size.unwrap_or(0), MAX_DIM)])?;
        check_context(path, "max_sequence_length", self.max_sequence_length)?;
        check_norm(path, self.rms_norm_eps, self.rope_theta)?;
        let bad = |r: &str| Err(Error::config(path, format!("{r} is not supported for LLaDA")));
        if self.include_bias || self.include_qkv_bias {
            return bad("include_bias / include_qkv_bias = true");
        }
        let is = |v: &Option<String>, ok: &[&str]| v.as_deref().is_none_or(|s| ok.contains(&s));
        if !is(&self.block_type, &["llama"]) {
            return bad(&format!("block_type {:?}", self.block_type));
        }
        if !is(&self.activation_type, &["silu", "swiglu"]) {
            return bad(&format!("activation_type {:?}", self.activation_type));
        }
        if !is(&self.layer_norm_type, &["rms"]) {
            return bad(&format!("layer_norm_type {:?}", self.layer_norm_type));
        }
        if self.rope == Some(false) || self.alibi == Some(true) || self.attention_layer_norm == Some(true) {
            return bad("rope = false, alibi or attention_layer_norm");
        }
        check_mask(path, self.mask_token_id(), self.vocab_size)
    }

    /// GSAI-ML/LLaDA-8B-Instruct (shapes only; GPU benchmarks).
    pub fn llada_8b() -> Self {
        Self {
            d_model: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: Some(32),
            mlp_hidden_size: 12288,
            vocab_size: 126464,
            embedding_size: Some(126464),
            max_sequence_length: 4096,
            rope_theta: 500_000.0,
            rms_norm_eps: 1e-5,
            weight_tying: false,
            include_bias: false,
            include_qkv_bias: false,
            block_type: Some("llama".into()),
            activation_type: Some("silu".into()),
            layer_norm_type: Some("rms".into()),
            rope: Some(true),
            alibi: Some(false),
            attention_layer_norm: Some(false),
            mask_token_id: Some(Self::DEFAULT_MASK),
            bos_token_id: Some(126080),
            eos_token_id: Some(EosIds::One(126081)),
            pad_token_id: Some(126081),
            model_type: "llada".into(),
        }
    }
}

/// Dream-v0 (Dream-org/Dream-v0-*-7B, `model_type = "Dream"`): Qwen2 layout with q/k/v biases,
/// bidirectional attention, logits shifted by one.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct DreamConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// 131072 in the released config, but Dream's README limits input + output to 2048 tokens;
    /// the engine's `max_model_len` is the place to apply that.
    #[serde(default = "default_dream_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    /// The MLP activation; only SwiGLU's `silu` is implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosIds>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default = "default_dream_type")]
    pub model_type: String,
}

fn default_dream_max_pos() -> usize {
    131072
}
fn default_dream_type() -> String {
    "Dream".into()
}

impl DreamConfig {
    /// Dream's `<|mask|>` token.
    pub const DEFAULT_MASK: u32 = 151666;

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }
    pub fn mask_token_id(&self) -> u32 {
        self.mask_token_id.unwrap_or(Self::DEFAULT_MASK)
    }

    pub(crate) fn validate(&self, path: &str) -> Result<()> {
        let hd = derived_head_dim(path, self.head_dim, self.hidden_size, self.num_attention_heads)?;
        check_shapes(path, self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.num_attention_heads, self.kv_heads(), hd)?;
        check_context(path, "max_position_embeddings", self.max_position_embeddings)?;
        check_norm(path, self.rms_norm_eps, self.rope_theta)?;
        if self.use_sliding_window == Some(true) || self.rope_scaling.is_some() {
            return Err(Error::config(path, "use_sliding_window and rope_scaling are not supported for Dream"));
        }
        check_act(path, &self.hidden_act)?;
        check_mask(path, self.mask_token_id(), self.vocab_size)
    }

    /// Dream-org/Dream-v0-Instruct-7B (shapes only; GPU benchmarks).
    pub fn dream_7b() -> Self {
        Self {
            vocab_size: 152064,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: Some(4),
            head_dim: None,
            max_position_embeddings: 131072,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            use_sliding_window: Some(false),
            rope_scaling: None,
            hidden_act: Some("silu".into()),
            mask_token_id: Some(Self::DEFAULT_MASK),
            bos_token_id: Some(151643),
            eos_token_id: Some(EosIds::One(151643)),
            pad_token_id: Some(151643),
            model_type: "Dream".into(),
        }
    }
}

/// LLaDA2.0 (inclusionAI/LLaDA2.0-mini / -flash, `model_type = "llada2_moe"`): the Ling-2.0 MoE
/// layout trained for block diffusion — fused QKV, per-head q/k RMSNorm, RoPE on the first
/// `partial_rotary_factor` of each head, dense first layers then MoE layers with a
/// group-limited sigmoid router and one shared expert.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct Llada2Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense layers' MLP width.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Layers `0..first_k_dense_replace` have a dense MLP, the rest MoE.
    #[serde(default = "one")]
    pub first_k_dense_replace: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    /// Expert groups of the router, of which the `topk_group` best (by the sum of each group's
    /// two best biased scores) may be chosen from.
    #[serde(default = "one")]
    pub n_group: usize,
    #[serde(default = "one")]
    pub topk_group: usize,
    pub moe_intermediate_size: usize,
    #[serde(default = "one")]
    pub num_shared_experts: usize,
    #[serde(default = "unit")]
    pub routed_scaling_factor: f64,
    /// Only `sigmoid` is implemented (the release; the code hard-codes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_function: Option<String>,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    /// Whether the MoE layers have `mlp.gate.expert_bias` (the releases do).
    #[serde(default = "yes")]
    pub moe_router_enable_expert_bias: bool,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "half")]
    pub partial_rotary_factor: f64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Absent from the released config; the family's code defaults it to on.
    #[serde(default = "yes")]
    pub use_qk_norm: bool,
    #[serde(default)]
    pub use_qkv_bias: bool,
    #[serde(default)]
    pub use_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_llada2_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    /// Not in the released config (the family's code hard-codes 156895).
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    /// The block length of decoding (32 in every reference; not in the released config).
    #[serde(default)]
    pub block_size: Option<usize>,
    #[serde(default)]
    pub eos_token_id: Option<EosIds>,
    #[serde(default = "default_llada2_type")]
    pub model_type: String,
}

fn one() -> usize {
    1
}
fn unit() -> f64 {
    1.0
}
fn half() -> f64 {
    0.5
}
fn yes() -> bool {
    true
}
fn default_llada2_max_pos() -> usize {
    32768
}
fn default_llada2_type() -> String {
    "llada2_moe".into()
}

impl Llada2Config {
    /// `<|mask|>`, hard-coded by every reference implementation.
    pub const DEFAULT_MASK: u32 = 156895;
    /// `<|endoftext|>`, the references' default EOS.
    pub const DEFAULT_EOS: u32 = 156892;
    /// Blocks of 32 in every reference and evaluation.
    pub const DEFAULT_BLOCK: usize = 32;

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }
    /// The rotated leading dims of each head (64 of 128 in the release), `head_dim × factor`
    /// rounded down as the released code does.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim() as f64 * self.partial_rotary_factor).floor() as usize
    }
    pub fn mask_token_id(&self) -> u32 {
        self.mask_token_id.unwrap_or(Self::DEFAULT_MASK)
    }
    /// The config's EOS ids, else the family's default when it lies in the vocabulary.
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(e) => e.to_vec(),
            None if (Self::DEFAULT_EOS as usize) < self.vocab_size => vec![Self::DEFAULT_EOS],
            None => Vec::new(),
        }
    }

    pub(crate) fn validate(&self, path: &str) -> Result<()> {
        let hd = derived_head_dim(path, self.head_dim, self.hidden_size, self.num_attention_heads)?;
        check_shapes(path, self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.num_attention_heads, self.kv_heads(), hd)?;
        check_bounds(
            path,
            &[
                ("num_experts", self.num_experts, MAX_EXPERTS),
                ("num_experts_per_tok", self.num_experts_per_tok, MAX_EXPERTS),
                ("n_group", self.n_group, MAX_EXPERTS),
                ("topk_group", self.topk_group, MAX_EXPERTS),
                ("num_shared_experts", self.num_shared_experts, MAX_EXPERTS),
                ("moe_intermediate_size", self.moe_intermediate_size, MAX_DIM),
                ("block_size", self.block_size.unwrap_or(0), MAX_CONTEXT),
            ],
        )?;
        check_context(path, "max_position_embeddings", self.max_position_embeddings)?;
        check_norm(path, self.rms_norm_eps, self.rope_theta)?;
        check_act(path, &self.hidden_act)?;
        let bad = |r: String| Err(Error::config(path, r));
        if self.use_qkv_bias || self.use_bias {
            return bad("attention / MLP biases are not supported for LLaDA2 (the releases have none)".into());
        }
        if self.rope_scaling.is_some() {
            return bad("rope_scaling is not supported".into());
        }
        if !(self.partial_rotary_factor > 0.0 && self.partial_rotary_factor <= 1.0) || self.rotary_dim() == 0 || self.rotary_dim() % 2 != 0 {
            return bad(format!("partial_rotary_factor {} must give an even rotary width in (0, head_dim]", self.partial_rotary_factor));
        }
        if let Some(f) = self.score_function.as_deref().filter(|f| *f != "sigmoid") {
            return bad(format!("score_function `{f}` is not supported (only sigmoid)"));
        }
        if self.num_hidden_layers > self.first_k_dense_replace {
            if let Some(reason) = crate::diffusion::models::Llada2::router(self).shape_error() {
                return bad(reason);
            }
            if self.moe_intermediate_size == 0 {
                return bad("moe_intermediate_size must be > 0".into());
            }
        }
        if !(self.routed_scaling_factor > 0.0) {
            return bad("routed_scaling_factor must be > 0".into());
        }
        if self.block_size == Some(0) {
            return bad("block_size must be > 0".into());
        }
        check_mask(path, self.mask_token_id(), self.vocab_size)
    }

    /// inclusionAI/LLaDA2.0-flash (shapes only; GPU benchmarks): LLaDA2.0-mini's layout at
    /// 102.9 B parameters (6.2 B active), 206 GB in bf16 — more than one GPU holds.
    pub fn llada2_flash() -> Self {
        Self {
            hidden_size: 4096,
            intermediate_size: 9216,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            moe_intermediate_size: 1024,
            max_position_embeddings: 16384,
            ..Self::llada2_mini()
        }
    }

    /// inclusionAI/LLaDA2.0-mini (shapes only; GPU benchmarks).
    pub fn llada2_mini() -> Self {
        Self {
            vocab_size: 157184,
            hidden_size: 2048,
            intermediate_size: 5120,
            num_hidden_layers: 20,
            num_attention_heads: 16,
            num_key_value_heads: Some(4),
            head_dim: Some(128),
            first_k_dense_replace: 1,
            num_experts: 256,
            num_experts_per_tok: 8,
            n_group: 8,
            topk_group: 4,
            moe_intermediate_size: 512,
            num_shared_experts: 1,
            routed_scaling_factor: 2.5,
            score_function: Some("sigmoid".into()),
            norm_topk_prob: true,
            moe_router_enable_expert_bias: true,
            rope_theta: 600000.0,
            partial_rotary_factor: 0.5,
            rms_norm_eps: 1e-6,
            use_qk_norm: true,
            use_qkv_bias: false,
            use_bias: false,
            tie_word_embeddings: false,
            max_position_embeddings: 32768,
            rope_scaling: None,
            hidden_act: Some("silu".into()),
            mask_token_id: None,
            block_size: None,
            eos_token_id: Some(EosIds::One(Self::DEFAULT_EOS)),
            model_type: "llada2_moe".into(),
        }
    }
}
