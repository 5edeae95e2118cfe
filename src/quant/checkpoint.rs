//! Checkpoints stored in FP8: `config.json`'s `quantization_config` read into how each FP8
//! weight's scales are stored beside it. Two layouts are read:
//!
//! - **compressed-tensors** (`"quant_method": "compressed-tensors"`, float weights of 8 bits):
//!   `X.weight` in E4M3 and `X.weight_scale` — one per output channel (`[out, 1]`), one per
//!   tensor (`[1]` or a scalar), or one per block (`"strategy": "block"`, `block_structure`).
//!   Activation scales, if any, are not used: activations stay in the engine's dtype.
//! - **fine-grained FP8** (`"quant_method": "fp8"`, DeepSeek-V3's and LLaDA2.x's releases):
//!   `X.weight` in E4M3 and `X.weight_scale_inv` `[ceil(out / b0), ceil(in / b1)]` for
//!   `weight_block_size` `[b0, b1]` (the multiplier back to the weight, despite its name).
//!
//! Anything else (integer formats, other bit widths) is a typed [`crate::Error::BadConfig`].

use crate::{Error, Result};

/// Where an FP8 checkpoint keeps each weight's scales.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointQuant {
    /// `X.weight_scale`: per output channel or per tensor, or per block when `block` is set.
    CompressedTensors { block: Option<(usize, usize)> },
    /// `X.weight_scale_inv`, one per `block` tile.
    FineGrainedFp8 { block: (usize, usize) },
}

impl CheckpointQuant {
    /// The layout `config.json` declares (`None` without a `quantization_config`).
    pub fn from_config(config: &serde_json::Value, path: &str) -> Result<Option<Self>> {
        let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else { return Ok(None) };
        let bad = |reason: String| Error::config(path, format!("quantization_config: {reason}"));
        let method = q.get("quant_method").and_then(|m| m.as_str()).ok_or_else(|| bad("no `quant_method`".into()))?;
        let block = |v: Option<&serde_json::Value>| -> Result<Option<(usize, usize)>> {
            let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
            match v.as_array().map(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<_>>>()) {
                Some(Some(b)) if b.len() == 2 && b.iter().all(|&d| d > 0 && d <= crate::config::MAX_DIM as u64) => Ok(Some((b[0] as usize, b[1] as usize))),
                _ => Err(bad(format!("block size {v} is not two integers in 1 ..= {}", crate::config::MAX_DIM))),
            }
        };
        match method {
            "fp8" => {
                if let Some(fmt) = q.get("fmt").and_then(|f| f.as_str()).filter(|f| *f != "e4m3") {
                    return Err(bad(format!("FP8 format `{fmt}` is not supported (e4m3 is)")));
                }
                let block = block(q.get("weight_block_size"))?.ok_or_else(|| bad("`quant_method: fp8` without `weight_block_size` is not supported".into()))?;
                Ok(Some(Self::FineGrainedFp8 { block }))
            }
            "compressed-tensors" => {
                let groups = q.get("config_groups").and_then(|g| g.as_object()).ok_or_else(|| bad("no `config_groups`".into()))?;
                let mut found = None;
                for (name, g) in groups {
                    let w = g.get("weights").ok_or_else(|| bad(format!("group `{name}` has no `weights`")))?;
                    let (bits, kind) = (w.get("num_bits").and_then(|b| b.as_u64()), w.get("type").and_then(|t| t.as_str()));
                    if bits != Some(8) || kind != Some("float") {
                        return Err(bad(format!(
                            "group `{name}`: {} weights of {} bits are not supported (8-bit float is)",
                            kind.unwrap_or("?"),
                            bits.map_or("?".into(), |b| b.to_string())
                        )));
                    }
                    let strategy = w.get("strategy").and_then(|s| s.as_str()).unwrap_or("tensor");
                    let this = match strategy {
                        "channel" | "tensor" => Self::CompressedTensors { block: None },
                        "block" => Self::CompressedTensors {
                            block: Some(
                                block(w.get("block_structure"))?.ok_or_else(|| bad(format!("group `{name}`: block strategy without `block_structure`")))?,
                            ),
                        },
                        other => return Err(bad(format!("group `{name}`: weight strategy `{other}` is not supported (channel, tensor, block are)"))),
                    };
                    if found.as_ref().is_some_and(|f| f != &this) {
                        return Err(bad("groups with different weight scales are not supported".into()));
                    }
                    found = Some(this);
                }
                found.map(Some).ok_or_else(|| bad("`config_groups` is empty".into()))
            }
            other => Err(bad(format!("quant_method `{other}` is not supported (fp8 and compressed-tensors float8 are)"))),
        }
    }

    /// The name of the scale tensor stored beside `weight` (`X.weight`).
    pub fn scale_name(&self, weight: &str) -> String {
        match self {
            Self::CompressedTensors { .. } => format!("{weight}_scale"),
            Self::FineGrainedFp8 { .. } => format!("{weight}_scale_inv"),
        }
    }

    /// The block scales' tile, if the scales are per block.
    pub fn block(&self) -> Option<(usize, usize)> {
        match self {
            Self::CompressedTensors { block } => *block,
            Self::FineGrainedFp8 { block } => Some(*block),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(q: serde_json::Value) -> Result<Option<CheckpointQuant>> {
        CheckpointQuant::from_config(&json!({ "quantization_config": q }), "config.json")
    }

    #[test]
    fn the_two_fp8_layouts_are_read_and_others_are_typed_errors() {
        assert_eq!(CheckpointQuant::from_config(&json!({}), "c").unwrap(), None);
        assert_eq!(
            parse(json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})).unwrap(),
            Some(CheckpointQuant::FineGrainedFp8 { block: (128, 128) })
        );
        let ct =
            |w: serde_json::Value| parse(json!({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": w, "targets": ["Linear"]}}}));
        assert_eq!(ct(json!({"num_bits": 8, "type": "float", "strategy": "channel"})).unwrap(), Some(CheckpointQuant::CompressedTensors { block: None }));
        assert_eq!(
            ct(json!({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]})).unwrap(),
            Some(CheckpointQuant::CompressedTensors { block: Some((128, 128)) })
        );
        for bad in [
            ct(json!({"num_bits": 4, "type": "int", "strategy": "group"})),
            ct(json!({"num_bits": 8, "type": "float", "strategy": "token"})),
            parse(json!({"quant_method": "awq", "bits": 4})),
            parse(json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})),
            parse(json!({"quant_method": "fp8", "weight_block_size": [0, 128]})),
            parse(json!({"bits": 8})),
        ] {
            assert!(matches!(bad, Err(Error::BadConfig { .. })), "{bad:?}");
        }
    }
}
