//! Typed `config.json` per family, chosen by `model_type`.

use crate::{Error, Result};
use serde::Deserialize;

/// A parsed `config.json`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ModelConfig {
    Ouro(OuroConfig),
}

impl ModelConfig {
    /// Parses `config.json` text; `path` only labels errors.
    pub fn from_json(text: &str, path: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Head {
            model_type: Option<String>,
        }
        let head: Head = serde_json::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
        match head.model_type.as_deref() {
            Some("ouro") => {
                let c: OuroConfig = serde_json::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
                c.validate(path)?;
                Ok(Self::Ouro(c))
            }
            Some(other) => Err(Error::UnsupportedModel(other.to_string())),
            None => Err(Error::config(path, "missing `model_type`")),
        }
    }

    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Ouro(_) => "ouro",
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

/// `eos_token_id` appears both as one id and as a list in released configs.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(untagged)]
pub enum EosIds {
    One(u32),
    Many(Vec<u32>),
}

impl EosIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            Self::One(x) => vec![*x],
            Self::Many(v) => v.clone(),
        }
    }
}

fn default_max_pos() -> usize {
    65536
}
fn default_theta() -> f64 {
    1_000_000.0
}
fn default_eps() -> f64 {
    1e-6
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

    fn validate(&self, path: &str) -> Result<()> {
        let bad = |r: String| Err(Error::config(path, r));
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 || self.intermediate_size == 0 {
            return bad("vocab_size, hidden_size, intermediate_size and num_hidden_layers must be > 0".into());
        }
        if self.num_attention_heads == 0 || self.kv_heads() == 0 || self.num_attention_heads % self.kv_heads() != 0 {
            return bad(format!(
                "num_attention_heads {} must be a positive multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if self.head_dim() % 2 != 0 || self.head_dim() == 0 {
            return bad(format!("head_dim {} must be even and > 0", self.head_dim()));
        }
        if self.total_ut_steps == 0 {
            return bad("total_ut_steps must be >= 1".into());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatches_on_model_type() {
        let c = serde_json::to_string(&OuroConfig::ouro_1_4b()).unwrap();
        assert!(matches!(ModelConfig::from_json(&c, "x").unwrap(), ModelConfig::Ouro(_)));
        let bad = c.replace("\"ouro\"", "\"llama\"");
        assert!(matches!(ModelConfig::from_json(&bad, "x"), Err(Error::UnsupportedModel(_))));
        assert!(matches!(ModelConfig::from_json("{", "x"), Err(Error::BadConfig { .. })));
        let zero_heads = c.replace("\"num_attention_heads\":16", "\"num_attention_heads\":0");
        assert!(matches!(ModelConfig::from_json(&zero_heads, "x"), Err(Error::BadConfig { .. })));
    }
}
