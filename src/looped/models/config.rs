//! The looped families' `config.json`s, field names as released: Ouro and Huginn.

use crate::config::{check_bounds, check_context, check_shapes, default_eps, default_theta, EosIds, MAX_DIM, MAX_LAYERS};
use crate::{Error, Result};
use serde::Deserialize;

/// Most loops an Ouro checkpoint may ask for: the released models loop 4 times, and every loop
/// step costs a KV slot under the depth-indexed layout, so a larger number is a broken config,
/// not a model (it would size the KV pool in terabytes).
pub const MAX_OURO_LOOPS: usize = 64;
/// Most recurrences a Huginn config may set as `max_steps` (the released model is evaluated at
/// up to 64; each step is a core launch).
pub const MAX_HUGINN_STEPS: usize = 1024;

/// Huginn-0125 (`tomg-group-umd/huginn-0125`, `model_type = "huginn_raven"`): prelude, a
/// recurrent core and a coda of sandwich blocks. Field names as in the released `config.json`.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
pub struct HuginnConfig {
    pub n_embd: usize,
    #[serde(alias = "num_attention_heads")]
    pub n_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    #[serde(default)]
    pub padded_vocab_size: Option<usize>,
    pub n_layers_in_prelude: usize,
    pub n_layers_in_recurrent_block: usize,
    pub n_layers_in_coda: usize,
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    #[serde(default = "default_huginn_rope")]
    pub rope_base: f64,
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
    #[serde(default = "default_true")]
    pub qk_bias: bool,
    #[serde(default = "default_true")]
    pub tie_embeddings: bool,
    /// Trained mean of the recurrence; serving uses `max_steps` (r_max, default 16).
    #[serde(default = "default_mean_recurrence")]
    pub mean_recurrence: usize,
    /// r_max when served (not in the released config; the CDB authors use 16).
    #[serde(default = "default_huginn_steps")]
    pub max_steps: usize,
    #[serde(default = "default_injection")]
    pub injection_type: String,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosIds>,
    #[serde(default = "default_huginn_type")]
    pub model_type: String,
}

fn default_block_size() -> usize {
    4096
}
fn default_huginn_rope() -> f64 {
    50_000.0
}
fn default_true() -> bool {
    true
}
fn default_mean_recurrence() -> usize {
    32
}
fn default_huginn_steps() -> usize {
    16
}
fn default_injection() -> String {
    "linear".into()
}
fn default_huginn_type() -> String {
    "huginn_raven".into()
}

impl HuginnConfig {
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.n_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.n_embd / self.n_heads.max(1))
    }
    /// Rows of the embedding and the LM head (the vocabulary padded for the kernels).
    pub fn table_rows(&self) -> usize {
        self.padded_vocab_size.unwrap_or(self.vocab_size).max(self.vocab_size)
    }
    /// Physical attention layers: prelude, core and coda.
    pub fn num_layers(&self) -> usize {
        self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda
    }

    pub(crate) fn validate(&self, path: &str) -> Result<()> {
        let bad = |r: String| Err(Error::config(path, r));
        // The core's layer count stands for the stack; the prelude and coda may be empty.
        check_shapes(
            path,
            self.vocab_size,
            self.n_embd,
            self.intermediate_size,
            self.n_layers_in_recurrent_block,
            self.n_heads,
            self.kv_heads(),
            self.head_dim(),
        )?;
        check_bounds(
            path,
            &[
                ("padded_vocab_size", self.padded_vocab_size.unwrap_or(0), MAX_DIM),
                ("n_layers_in_prelude", self.n_layers_in_prelude, MAX_LAYERS),
                ("n_layers_in_coda", self.n_layers_in_coda, MAX_LAYERS),
            ],
        )?;
        check_context(path, "block_size", self.block_size)?;
        if self.n_heads * self.head_dim() != self.n_embd {
            return bad(format!("n_heads {} x head_dim {} != n_embd {}", self.n_heads, self.head_dim(), self.n_embd));
        }
        if self.injection_type != "linear" {
            return bad(format!("injection_type `{}` is not supported (only `linear`)", self.injection_type));
        }
        if self.max_steps == 0 || !(self.norm_eps > 0.0) || !(self.rope_base > 0.0) {
            return bad("max_steps, norm_eps and rope_base must be > 0".into());
        }
        if self.max_steps > MAX_HUGINN_STEPS {
            return bad(format!("max_steps {} exceeds the {MAX_HUGINN_STEPS} recurrences Huginn is served with here", self.max_steps));
        }
        Ok(())
    }

    /// The released Huginn-0125 configuration with r_max 16 (shapes only; GPU benchmarks).
    pub fn huginn_0125() -> Self {
        Self::huginn_0125_with(Some(65504), Some(EosIds::One(65505)))
    }

    pub(crate) fn huginn_0125_with(bos_token_id: Option<u32>, eos_token_id: Option<EosIds>) -> Self {
        Self {
            n_embd: 5280,
            n_heads: 55,
            num_key_value_heads: Some(55),
            head_dim: Some(96),
            intermediate_size: 17920,
            vocab_size: 65536,
            padded_vocab_size: Some(65536),
            n_layers_in_prelude: 2,
            n_layers_in_recurrent_block: 4,
            n_layers_in_coda: 2,
            block_size: 4096,
            rope_base: 50_000.0,
            norm_eps: 1e-6,
            qk_bias: true,
            tie_embeddings: true,
            mean_recurrence: 32,
            max_steps: 16,
            injection_type: "linear".into(),
            bos_token_id,
            eos_token_id,
            model_type: "huginn_raven".into(),
        }
    }
}

/// Ouro (ByteDance) config, field names as in the released `config.json`.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
pub struct OuroConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_ut_steps")]
    pub total_ut_steps: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosIds>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
}

fn default_max_pos() -> usize {
    65536
}
fn default_ut_steps() -> usize {
    4
}
fn default_model_type() -> String {
    "ouro".into()
}

impl OuroConfig {
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub(crate) fn validate(&self, path: &str) -> Result<()> {
        let bad = |r: String| Err(Error::config(path, r));
        check_shapes(
            path,
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.kv_heads(),
            self.head_dim(),
        )?;
        check_context(path, "max_position_embeddings", self.max_position_embeddings)?;
        if self.total_ut_steps == 0 || self.total_ut_steps > MAX_OURO_LOOPS {
            return bad(format!("total_ut_steps {} must be in 1..={MAX_OURO_LOOPS}", self.total_ut_steps));
        }
        if !(self.rms_norm_eps > 0.0) || !(self.rope_theta > 0.0) {
            return bad("rms_norm_eps and rope_theta must be > 0".into());
        }
        Ok(())
    }

    /// The released Ouro-1.4B configuration (shapes only; used by GPU benchmarks).
    pub fn ouro_1_4b() -> Self {
        Self {
            vocab_size: 49152,
            hidden_size: 2048,
            intermediate_size: 5632,
            num_hidden_layers: 24,
            num_attention_heads: 16,
            num_key_value_heads: Some(16),
            head_dim: None,
            max_position_embeddings: 65536,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            total_ut_steps: 4,
            tie_word_embeddings: false,
            bos_token_id: Some(1),
            eos_token_id: Some(EosIds::One(2)),
            model_type: "ouro".into(),
        }
    }
}
