//! `config.json` of the masked-diffusion families: SDAR (Qwen3 keys), LLaDA (OLMo-style keys)
//! and Dream (Qwen2 keys). Field names as in the released checkpoints.

use super::{default_eps, default_theta, EosIds};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Shared shape checks; `head_dim` is the resolved one.
#[allow(clippy::too_many_arguments)]
fn check_shapes(path: &str, vocab: usize, hidden: usize, inter: usize, layers: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
    let bad = |r: String| Err(Error::config(path, r));
    if vocab == 0 || hidden == 0 || inter == 0 || layers == 0 {
        return bad("vocabulary, hidden, intermediate sizes and the layer count must be > 0".into());
    }
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return bad(format!("{heads} attention heads must be a positive multiple of {kv_heads} kv heads"));
    }
    if head_dim == 0 || head_dim % 2 != 0 {
        return bad(format!("head_dim {head_dim} must be even and > 0"));
    }
    Ok(())
}

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

    pub(crate) fn validate(&self, path: &str) -> Result<()> {
        let hd = derived_head_dim(path, self.head_dim, self.hidden_size, self.num_attention_heads)?;
        check_shapes(path, self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.num_attention_heads, self.kv_heads(), hd)?;
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
