//! `config.json` of a checkpoint: the family by `model_type` ([`ModelConfig`]), and the bounds
//! every family's config is checked against before anything is sized from it.

use crate::diffusion::models::{DreamConfig, Llada2Config, LladaConfig, SdarConfig};
use crate::looped::models::{HuginnConfig, OuroConfig};
use crate::{Error, Result};
use serde::Deserialize;

/// Upper bounds on the sizes a config may state: far above any released model (vocabularies of
/// ≈ 256 k, hidden sizes of ≈ 16 k, ≈ 100 layers, 256 experts, contexts of ≈ 1 M), low enough that
/// no weight-shape product overflows and nothing sized from a count (a per-layer table, a
/// per-position state) asks for absurd memory. A config beyond them is broken, not a model.
pub(crate) const MAX_DIM: usize = 1 << 20;
pub(crate) const MAX_LAYERS: usize = 1 << 12;
pub(crate) const MAX_EXPERTS: usize = 1 << 12;
pub(crate) const MAX_CONTEXT: usize = 1 << 24;

/// A context window (`field` names it as the config does) that holds at least one token and stays
/// within [`MAX_CONTEXT`]: a window of 0 would build an engine that refuses every request.
pub(crate) fn check_context(path: &str, field: &str, window: usize) -> Result<()> {
    if window == 0 {
        return Err(Error::config(path, format!("{field} must be > 0")));
    }
    check_bounds(path, &[(field, window, MAX_CONTEXT)])
}

/// Each `(field, value, bound)` within its bound.
pub(crate) fn check_bounds(path: &str, fields: &[(&str, usize, usize)]) -> Result<()> {
    match fields.iter().find(|&&(_, v, max)| v > max) {
        Some((name, v, max)) => Err(Error::config(path, format!("{name} = {v} exceeds {max}, beyond any model this library serves"))),
        None => Ok(()),
    }
}

/// The sizes every family's attention stack needs (`head_dim` resolved): non-zero, within the
/// bounds, heads a multiple of the KV heads, an even head dim.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_shapes(path: &str, vocab: usize, hidden: usize, inter: usize, layers: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
    let bad = |r: String| Err(Error::config(path, r));
    check_bounds(
        path,
        &[
            ("vocabulary size", vocab, MAX_DIM),
            ("hidden size", hidden, MAX_DIM),
            ("intermediate size", inter, MAX_DIM),
            ("layer count", layers, MAX_LAYERS),
            ("attention heads", heads, MAX_DIM),
            ("kv heads", kv_heads, MAX_DIM),
            ("head_dim", head_dim, MAX_DIM),
        ],
    )?;
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

/// A parsed `config.json`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ModelConfig {
    Ouro(OuroConfig),
    Huginn(HuginnConfig),
    Sdar(SdarConfig),
    Llada(LladaConfig),
    Llada2(Llada2Config),
    Dream(DreamConfig),
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
            Some("huginn_raven") => {
                let c: HuginnConfig = serde_json::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
                c.validate(path)?;
                Ok(Self::Huginn(c))
            }
            // The MoE checkpoints (Qwen3-MoE layers) share SDAR's config class.
            Some("sdar" | "sdar_moe") => {
                let c: SdarConfig = serde_json::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
                c.validate(path)?;
                Ok(Self::Sdar(c))
            }
            Some("llada") => {
                let c: LladaConfig = serde_json::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
                c.validate(path)?;
                Ok(Self::Llada(c))
            }
            Some("llada2_moe") => {
                let c: Llada2Config = serde_json::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
                c.validate(path)?;
                Ok(Self::Llada2(c))
            }
            // The released config says "Dream"; accept the lower-case spelling too.
            Some("Dream" | "dream") => {
                let c: DreamConfig = serde_json::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
                c.validate(path)?;
                Ok(Self::Dream(c))
            }
            Some(other) => Err(Error::UnsupportedModel(other.to_string())),
            None => Err(Error::config(path, "missing `model_type`")),
        }
    }

    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Ouro(_) => "ouro",
            Self::Huginn(_) => "huginn_raven",
            Self::Sdar(c) if c.model_type == "sdar_moe" => "sdar_moe",
            Self::Sdar(_) => "sdar",
            Self::Llada(_) => "llada",
            Self::Llada2(_) => "llada2_moe",
            Self::Dream(_) => "Dream",
        }
    }

    /// Tokens that end a request besides the eos ids, by their text (looked up in the tokenizer):
    /// LLaDA2.0's end of turn `<|role_end|>`, on which its evaluations stop.
    pub fn stop_tokens(&self) -> &'static [&'static str] {
        match self {
            Self::Llada2(_) => &["<|role_end|>"],
            _ => &[],
        }
    }

    /// eos ids named by `config.json` itself.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self {
            Self::Ouro(c) => c.eos_token_id.as_ref().map(EosIds::to_vec).unwrap_or_default(),
            Self::Huginn(c) => c.eos_token_id.as_ref().map(EosIds::to_vec).unwrap_or_default(),
            Self::Sdar(c) => c.eos_token_id.as_ref().map(EosIds::to_vec).unwrap_or_default(),
            Self::Llada(c) => c.eos_token_id.as_ref().map(EosIds::to_vec).unwrap_or_default(),
            Self::Llada2(c) => c.eos_ids(),
            Self::Dream(c) => c.eos_token_id.as_ref().map(EosIds::to_vec).unwrap_or_default(),
        }
    }
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

pub(crate) fn default_theta() -> f64 {
    1_000_000.0
}
pub(crate) fn default_eps() -> f64 {
    1e-6
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes no model has (each would overflow a shape product or size a table from a count
    /// before the weights are read) are a config error, not a panic or an aborted allocation.
    #[test]
    fn absurd_sizes_are_config_errors() {
        let huge = serde_json::json!(18446744073709551615u64);
        let cases: Vec<(serde_json::Value, &[&str])> = vec![
            (serde_json::to_value(OuroConfig::ouro_1_4b()).unwrap(), &["head_dim", "num_hidden_layers", "max_position_embeddings", "vocab_size"]),
            (serde_json::to_value(HuginnConfig::huginn_0125()).unwrap(), &["head_dim", "block_size", "n_layers_in_coda", "padded_vocab_size"]),
            (serde_json::to_value(SdarConfig::sdar_8b_chat_b32()).unwrap(), &["num_hidden_layers", "head_dim", "num_experts", "block_size"]),
            (serde_json::to_value(LladaConfig::llada_8b()).unwrap(), &["n_layers", "max_sequence_length", "embedding_size"]),
            (serde_json::to_value(DreamConfig::dream_7b()).unwrap(), &["num_hidden_layers", "max_position_embeddings"]),
            (
                serde_json::to_value(Llada2Config::llada2_mini()).unwrap(),
                &["num_hidden_layers", "topk_group", "num_shared_experts", "moe_intermediate_size", "block_size"],
            ),
        ];
        for (base, fields) in cases {
            assert!(ModelConfig::from_json(&base.to_string(), "x").is_ok(), "{base}");
            for field in fields {
                for v in [huge.clone(), serde_json::json!(10_000_000_000_000u64)] {
                    let mut c = base.clone();
                    c[*field] = v;
                    let got = ModelConfig::from_json(&c.to_string(), "x");
                    assert!(matches!(&got, Err(Error::BadConfig { reason, .. }) if reason.contains("exceeds")), "{field}: {got:?}");
                }
            }
        }
    }

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

    #[test]
    fn llada2_config_reads_the_released_keys_and_fills_the_family_defaults() {
        // The keys of LLaDA2.0-mini's config.json (mask, block and qk-norm are not in it).
        let text = r#"{"model_type": "llada2_moe", "vocab_size": 157184, "hidden_size": 2048, "intermediate_size": 5120,
            "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
            "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
            "moe_intermediate_size": 512, "num_shared_experts": 1, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
            "moe_router_enable_expert_bias": true, "norm_topk_prob": true, "router_dtype": "fp32", "rope_theta": 600000,
            "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "hidden_act": "silu", "use_qkv_bias": false, "use_bias": false,
            "tie_word_embeddings": false, "use_sliding_window": false, "sliding_window": 4096, "pad_token_id": 156892,
            "max_position_embeddings": 32768, "rope_scaling": null, "torch_dtype": "bfloat16"}"#;
        let ModelConfig::Llada2(c) = ModelConfig::from_json(text, "x").unwrap() else { panic!("not llada2") };
        assert_eq!((c.mask_token_id(), c.eos_ids(), c.rotary_dim(), c.use_qk_norm), (156895, vec![156892], 64, true));
        assert_eq!(c, Llada2Config { eos_token_id: None, score_function: Some("sigmoid".into()), ..Llada2Config::llada2_mini() });
        // One group with MLX's default topk_group, and an all-dense config without groups.
        let one_group = text.replace("\"n_group\": 8", "\"n_group\": 1");
        assert!(ModelConfig::from_json(&one_group, "x").is_ok());
        let dense = text.replace("\"first_k_dense_replace\": 1", "\"first_k_dense_replace\": 20").replace("\"n_group\": 8", "\"n_group\": 0");
        assert!(ModelConfig::from_json(&dense, "x").is_ok());
        for bad in [
            ("\"sigmoid\"", "\"softmax\""),
            ("\"partial_rotary_factor\": 0.5", "\"partial_rotary_factor\": 0.2"),
            ("\"topk_group\": 4", "\"topk_group\": 9"),
            ("\"n_group\": 8", "\"n_group\": 3"),
        ] {
            let t = text.replace(bad.0, bad.1);
            assert!(matches!(ModelConfig::from_json(&t, "x"), Err(Error::BadConfig { .. })), "{bad:?}");
        }
    }

    #[test]
    fn huginn_config_reads_released_field_names() {
        // The released config names heads `n_heads`; the minimal config `num_attention_heads`.
        let text = r#"{"model_type": "huginn_raven", "n_embd": 5280, "n_heads": 55, "num_key_value_heads": 55,
            "head_dim": 96, "intermediate_size": 17920, "vocab_size": 65536, "padded_vocab_size": 65536,
            "n_layers": 8, "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
            "injection_type": "linear", "state_init": "like-init", "mean_recurrence": 32, "norm_eps": 1e-06,
            "qk_bias": true, "tie_embeddings": true, "rope_base": 50000, "block_size": 4096, "bias": false}"#;
        let ModelConfig::Huginn(c) = ModelConfig::from_json(text, "x").unwrap() else { panic!("not huginn") };
        assert_eq!(c, HuginnConfig::huginn_0125_with(c.bos_token_id, c.eos_token_id.clone()));
        let alias = text.replace("\"n_heads\"", "\"num_attention_heads\"");
        assert!(matches!(ModelConfig::from_json(&alias, "x").unwrap(), ModelConfig::Huginn(_)));
        let bad = text.replace("\"linear\"", "\"additive\"");
        assert!(matches!(ModelConfig::from_json(&bad, "x"), Err(Error::BadConfig { .. })));
    }
}
