//! Random-weight models in the real checkpoint layouts: the tiny test models, the shipped
//! default until trained weights land, and the real-shape GPU benchmark models.

use crate::diffusion::models::{DreamConfig, Llada2Config, LladaConfig, SdarConfig};
use crate::loader::Weights;
use crate::looped::models::{HuginnConfig, OuroConfig};
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// Every tensor of an Ouro checkpoint with its shape, named exactly as the released
/// `ByteDance/Ouro-*` `model.safetensors`.
pub fn ouro_tensor_manifest(cfg: &OuroConfig) -> Vec<(String, Vec<usize>)> {
    let (h, v, i) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_attention_heads * cfg.head_dim(), cfg.kv_heads() * cfg.head_dim());
    let mut m = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        m.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
        m.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
        m.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
        m.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        m.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
        m.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
        m.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        for n in ["input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"] {
            m.push((format!("{p}.{n}.weight"), vec![h]));
        }
    }
    m.push(("model.norm.weight".into(), vec![h]));
    m.push(("model.early_exit_gate.weight".into(), vec![1, h]));
    m.push(("model.early_exit_gate.bias".into(), vec![1]));
    if !cfg.tie_word_embeddings {
        m.push(("lm_head.weight".into(), vec![v, h]));
    }
    m
}

/// Every tensor of a Huginn checkpoint with its shape, named exactly as the released
/// `tomg-group-umd/huginn-0125` shards (`freqs_cis` omitted: it is recomputed).
pub fn huginn_tensor_manifest(cfg: &HuginnConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, rows) = (cfg.n_embd, cfg.intermediate_size, cfg.table_rows());
    let (nh, nkv, hd) = (cfg.n_heads, cfg.kv_heads(), cfg.head_dim());
    let mut m = vec![("transformer.wte.weight".to_string(), vec![rows, h]), ("lm_head.weight".to_string(), vec![rows, h])];
    let groups = [("prelude", cfg.n_layers_in_prelude), ("core_block", cfg.n_layers_in_recurrent_block), ("coda", cfg.n_layers_in_coda)];
    for (group, n) in groups {
        for j in 0..n {
            let p = format!("transformer.{group}.{j}");
            for k in 1..=4 {
                m.push((format!("{p}.norm_{k}.weight"), vec![h]));
            }
            m.push((format!("{p}.attn.Wqkv.weight"), vec![(nh + 2 * nkv) * hd, h]));
            if cfg.qk_bias {
                m.push((format!("{p}.attn.qk_bias"), vec![2, 1, nh, hd]));
            }
            m.push((format!("{p}.attn.proj.weight"), vec![h, nh * hd]));
            m.push((format!("{p}.mlp.fc.weight"), vec![2 * i, h]));
            m.push((format!("{p}.mlp.proj.weight"), vec![h, i]));
        }
    }
    m.push(("transformer.adapter.weight".into(), vec![h, 2 * h]));
    m.push(("transformer.ln_f.weight".into(), vec![h]));
    m
}

/// Random tensors for `manifest`: norm gains near 1, matrices N(0, 0.02²) (embeddings N(0, 1)
/// so tokens are well separated in tiny models), biases named `*.bias` 0. Deterministic for a given seed on the
/// CPU; on CUDA the device generator is seeded instead.
pub fn random_tensors(manifest: &[(String, Vec<usize>)], seed: u64, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !device.is_cpu() {
        device.set_seed(seed)?;
    }
    let mut rng = SplitMix(seed);
    let mut out = HashMap::new();
    for (name, shape) in manifest {
        let n: usize = shape.iter().product();
        let t = if device.is_cpu() {
            let std = init_std(name);
            let data: Vec<f32> = if is_norm_weight(name) {
                (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect()
            } else if name.ends_with(".bias") {
                vec![0.0; n]
            } else {
                (0..n).map(|_| std * rng.normal()).collect()
            };
            Tensor::from_vec(data, shape.as_slice(), device)?
        } else if is_norm_weight(name) {
            (Tensor::randn(0f32, 0.1, shape.as_slice(), device)? + 1.0)?
        } else if name.ends_with(".bias") {
            Tensor::zeros(shape.as_slice(), DType::F32, device)?
        } else {
            Tensor::randn(0f32, init_std(name), shape.as_slice(), device)?
        };
        out.insert(name.clone(), t.to_dtype(stored_dtype(name, dtype))?);
    }
    Ok(out)
}

/// Random weights in `manifest`'s shapes made as a model reads them ([`Weights::lazy`]), each
/// tensor from its own seed (`seed` and its name): the same values on every device and in any
/// order, so the ranks of a tensor-parallel group make matching shards. A rank never holds the
/// whole model (LLaDA2.0-flash: 206 GB in bf16): it makes one tensor at a time and keeps its
/// share (under expert parallelism it makes only its own experts; otherwise each expert whole
/// for a moment, then its columns).
pub fn lazy_random_weights(manifest: &[(String, Vec<usize>)], seed: u64, dtype: DType, device: &Device) -> Weights {
    let dev = device.clone();
    let make = move |name: &str, shape: &[usize]| -> candle_core::Result<Tensor> {
        // FNV-1a of the name: a seed per tensor.
        let own = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)) ^ seed;
        let map = random_tensors(&[(name.to_string(), shape.to_vec())], own, dtype, &dev).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        map.into_values().next().ok_or_else(|| candle_core::Error::Msg(format!("no tensor made for {name}")))
    };
    Weights::lazy(manifest, std::sync::Arc::new(make), dtype, device)
}

/// The dtype a random tensor is kept in: the model's, except MoE routers and their selection
/// biases, which the loader reads in f32 (`Weights::get_as`). Converting each tensor as soon as
/// it is drawn keeps the device from holding an f32 copy of every weight (LLaDA2.0-mini: 64 GB).
fn stored_dtype(name: &str, dtype: DType) -> DType {
    if name.ends_with("mlp.gate.weight") || name.ends_with("expert_bias") {
        DType::F32
    } else {
        dtype
    }
}

/// A norm's gain: a `.weight` whose module is a norm — Ouro's `input_layernorm`,
/// `input_layernorm_2`, `post_attention_layernorm{,_2}` and `norm`, Huginn's `norm_1` … `norm_4`
/// and `ln_f`, the diffusion families' `*_norm` / `*layernorm`.
fn is_norm_weight(name: &str) -> bool {
    let mut parts = name.rsplit('.');
    parts.next() == Some("weight") && parts.next().is_some_and(|module| module.contains("norm") || module == "ln_f")
}

fn init_std(name: &str) -> f32 {
    if name.contains("embed_tokens") || name.ends_with("wte.weight") {
        1.0
    } else {
        0.02
    }
}

/// Random Ouro weights held in memory (GPU benchmarks generate them on the device).
pub fn random_ouro_weights(cfg: &OuroConfig, seed: u64, dtype: DType, device: &Device) -> Result<Weights> {
    Ok(Weights::from_map(random_tensors(&ouro_tensor_manifest(cfg), seed, dtype, device)?, dtype, device))
}

/// Writes a complete Ouro model directory (config.json, model.safetensors,
/// generation_config.json) with deterministic random f32 weights. Add a tokenizer.json
/// yourself if the model should take text.
pub fn write_random_ouro(dir: &Path, cfg: &OuroConfig, seed: u64) -> Result<()> {
    write_random_ouro_as(dir, cfg, seed, DType::F32)
}

/// [`write_random_ouro`] with the tensors stored in `dtype` (the released checkpoints are bf16).
pub fn write_random_ouro_as(dir: &Path, cfg: &OuroConfig, seed: u64, dtype: DType) -> Result<()> {
    let tensors = random_tensors(&ouro_tensor_manifest(cfg), seed, dtype, &Device::Cpu)?;
    let eos = cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default();
    write_model_dir(dir, &tensors, serde_json::to_value(cfg).expect("config serialises"), "OuroForCausalLM", &eos)
}

/// Writes a Huginn model directory (config.json with the released field names,
/// model.safetensors, generation_config.json) with deterministic random f32 weights.
pub fn write_random_huginn(dir: &Path, cfg: &HuginnConfig, seed: u64) -> Result<()> {
    let mut tensors = random_tensors(&huginn_tensor_manifest(cfg), seed, DType::F32, &Device::Cpu)?;
    // Tied: the released checkpoint stores the embedding twice.
    let wte = tensors["transformer.wte.weight"].clone();
    tensors.insert("lm_head.weight".into(), wte);
    let eos = cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default();
    write_model_dir(dir, &tensors, serde_json::to_value(cfg).expect("config serialises"), "RavenForCausalLM", &eos)
}

/// model.safetensors + config.json (with `architectures`) + generation_config.json.
fn write_model_dir(dir: &Path, tensors: &HashMap<String, Tensor>, mut config: serde_json::Value, architecture: &str, eos: &[u32]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    candle_core::safetensors::save(tensors, dir.join("model.safetensors"))?;
    config["architectures"] = serde_json::json!([architecture]);
    write(dir.join("config.json"), &serde_json::to_string_pretty(&config).expect("json"))?;
    write(dir.join("generation_config.json"), &serde_json::json!({ "eos_token_id": eos }).to_string())
}

/// A tiny Huginn config for tests: 1 prelude, 2 core, 1 coda block, r_max 6, MHA 4 × 16.
pub fn tiny_huginn_config(vocab_size: usize) -> HuginnConfig {
    HuginnConfig {
        n_embd: 64,
        n_heads: 4,
        num_key_value_heads: Some(4),
        head_dim: Some(16),
        intermediate_size: 96,
        vocab_size,
        padded_vocab_size: Some(vocab_size.next_multiple_of(8)),
        n_layers_in_prelude: 1,
        n_layers_in_recurrent_block: 2,
        n_layers_in_coda: 1,
        block_size: 512,
        rope_base: 50_000.0,
        norm_eps: 1e-6,
        qk_bias: true,
        tie_embeddings: true,
        mean_recurrence: 8,
        max_steps: 6,
        injection_type: "linear".into(),
        bos_token_id: None,
        eos_token_id: None,
        model_type: "huginn_raven".into(),
    }
}

fn write(path: std::path::PathBuf, text: &str) -> Result<()> {
    std::fs::write(&path, text).map_err(|source| Error::Io { path, source })
}

/// A tiny Ouro config for tests: 2 layers, 4 loops, 4 heads (2 KV heads, so GQA is covered).
pub fn tiny_ouro_config(vocab_size: usize) -> OuroConfig {
    OuroConfig {
        vocab_size,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(16),
        max_position_embeddings: 512,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        total_ut_steps: 4,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_id: None,
        model_type: "ouro".into(),
    }
}

/// Every tensor of an SDAR checkpoint (Qwen3 names, per-head q/k norms), as in
/// `JetLM/SDAR-8B-Chat`'s index: 11 per layer + embedding, final norm and (untied) LM head.
pub fn sdar_tensor_manifest(cfg: &SdarConfig) -> Vec<(String, Vec<usize>)> {
    let mut m = qwen_manifest(
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.head_dim(),
        false,
    );
    for l in 0..cfg.num_hidden_layers {
        for n in ["q_norm", "k_norm"] {
            m.push((format!("model.layers.{l}.self_attn.{n}.weight"), vec![cfg.head_dim()]));
        }
    }
    // Qwen3-MoE layers: a router and per-expert SwiGLUs instead of the dense MLP.
    let h = cfg.hidden_size;
    for (l, _) in cfg.moe_layers().iter().enumerate().filter(|(_, &moe)| moe) {
        let p = format!("model.layers.{l}.mlp.");
        m.retain(|(n, _)| !n.starts_with(&p));
        let (e, w) = (cfg.num_experts.unwrap_or(0), cfg.moe_intermediate_size.unwrap_or(0));
        m.push((format!("{p}gate.weight"), vec![e, h]));
        for x in 0..e {
            m.push((format!("{p}experts.{x}.gate_proj.weight"), vec![w, h]));
            m.push((format!("{p}experts.{x}.up_proj.weight"), vec![w, h]));
            m.push((format!("{p}experts.{x}.down_proj.weight"), vec![h, w]));
        }
    }
    if !cfg.tie_word_embeddings {
        m.push(("lm_head.weight".into(), vec![cfg.vocab_size, cfg.hidden_size]));
    }
    m
}

/// Every tensor of a Dream checkpoint (Qwen2 names, q/k/v biases).
pub fn dream_tensor_manifest(cfg: &DreamConfig) -> Vec<(String, Vec<usize>)> {
    let mut m = qwen_manifest(
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.head_dim(),
        true,
    );
    if !cfg.tie_word_embeddings {
        m.push(("lm_head.weight".into(), vec![cfg.vocab_size, cfg.hidden_size]));
    }
    m
}

/// Qwen2/Qwen3 embedding, layers and final norm (no LM head, no q/k norms).
#[allow(clippy::too_many_arguments)]
fn qwen_manifest(v: usize, h: usize, i: usize, layers: usize, nh: usize, nkv: usize, hd: usize, qkv_bias: bool) -> Vec<(String, Vec<usize>)> {
    let mut m = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (n, rows) in [("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)] {
            m.push((format!("{p}.self_attn.{n}.weight"), vec![rows, h]));
            if qkv_bias {
                m.push((format!("{p}.self_attn.{n}.bias"), vec![rows]));
            }
        }
        m.push((format!("{p}.self_attn.o_proj.weight"), vec![h, nh * hd]));
        m.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
        m.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
        m.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        m.push((format!("{p}.input_layernorm.weight"), vec![h]));
        m.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
    }
    m.push(("model.norm.weight".into(), vec![h]));
    m
}

/// Every tensor of a LLaDA checkpoint (`model.transformer.*`; `ff_proj` gate, `up_proj`
/// linear branch, `ff_out` down projection; the model-level `ff_out` is the LM head).
pub fn llada_tensor_manifest(cfg: &LladaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, rows) = (cfg.d_model, cfg.mlp_hidden_size, cfg.table_rows());
    let (q, kv) = (cfg.n_heads * cfg.head_dim(), cfg.kv_heads() * cfg.head_dim());
    let mut m = vec![("model.transformer.wte.weight".to_string(), vec![rows, h])];
    for l in 0..cfg.n_layers {
        let p = format!("model.transformer.blocks.{l}");
        m.push((format!("{p}.attn_norm.weight"), vec![h]));
        m.push((format!("{p}.q_proj.weight"), vec![q, h]));
        m.push((format!("{p}.k_proj.weight"), vec![kv, h]));
        m.push((format!("{p}.v_proj.weight"), vec![kv, h]));
        m.push((format!("{p}.attn_out.weight"), vec![h, q]));
        m.push((format!("{p}.ff_norm.weight"), vec![h]));
        m.push((format!("{p}.ff_proj.weight"), vec![i, h]));
        m.push((format!("{p}.up_proj.weight"), vec![i, h]));
        m.push((format!("{p}.ff_out.weight"), vec![h, i]));
    }
    m.push(("model.transformer.ln_f.weight".into(), vec![h]));
    if !cfg.weight_tying {
        m.push(("model.transformer.ff_out.weight".into(), vec![rows, h]));
    }
    m
}

/// [`random_tensors`] plus what its name rules miss in the diffusion layouts: biases drawn
/// N(0, 0.1²) (zeros would leave the bias path untested), LLaDA's `ln_f` near 1 and its `wte`
/// N(0, 1) like the other families' embeddings, and projection matrices N(0, 1/fan_in) — with
/// 0.02 a tiny model's masked positions all carry the mask embedding almost unchanged to the
/// head and decode to one token, which would make batching tests vacuous.
fn random_diffusion_tensors(manifest: &[(String, Vec<usize>)], seed: u64, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    let mut out = random_tensors(manifest, seed, dtype, device)?;
    let mut rng = SplitMix(seed ^ 0xD1FF_0510);
    for (name, shape) in manifest {
        let (mean, std) = if name.ends_with(".bias") {
            (0.0, 0.1)
        } else if name.ends_with("ln_f.weight") {
            (1.0, 0.1)
        } else if name.ends_with("wte.weight") {
            (0.0, 1.0)
        } else if shape.len() == 2 && !name.contains("embed_tokens") {
            (0.0, 1.0 / (shape[1] as f32).sqrt())
        } else {
            continue;
        };
        let t = if device.is_cpu() {
            let n: usize = shape.iter().product();
            Tensor::from_vec((0..n).map(|_| mean + std * rng.normal()).collect::<Vec<f32>>(), shape.as_slice(), device)?
        } else {
            Tensor::randn(mean, std, shape.as_slice(), device)?
        };
        out.insert(name.clone(), t.to_dtype(stored_dtype(name, dtype))?);
    }
    Ok(out)
}

/// Random SDAR weights held in memory.
pub fn random_sdar_weights(cfg: &SdarConfig, seed: u64, dtype: DType, device: &Device) -> Result<Weights> {
    Ok(Weights::from_map(random_diffusion_tensors(&sdar_tensor_manifest(cfg), seed, dtype, device)?, dtype, device))
}

/// Random LLaDA2.0 weights held in memory (the MoE checkpoints' layout). The map is generated in
/// f32 and converted to `dtype` as tensors are read (for the real shapes ≈ 65 GB of f32).
pub fn random_llada2_weights(cfg: &Llada2Config, seed: u64, dtype: DType, device: &Device) -> Result<Weights> {
    Ok(Weights::from_map(random_diffusion_tensors(&llada2_tensor_manifest(cfg), seed, dtype, device)?, dtype, device))
}

/// Random LLaDA weights held in memory.
pub fn random_llada_weights(cfg: &LladaConfig, seed: u64, dtype: DType, device: &Device) -> Result<Weights> {
    Ok(Weights::from_map(random_diffusion_tensors(&llada_tensor_manifest(cfg), seed, dtype, device)?, dtype, device))
}

/// Random Dream weights held in memory.
pub fn random_dream_weights(cfg: &DreamConfig, seed: u64, dtype: DType, device: &Device) -> Result<Weights> {
    Ok(Weights::from_map(random_diffusion_tensors(&dream_tensor_manifest(cfg), seed, dtype, device)?, dtype, device))
}

/// Writes an SDAR model directory (config.json, model.safetensors, generation_config.json)
/// with deterministic random f32 weights in the released layout.
pub fn write_random_sdar(dir: &Path, cfg: &SdarConfig, seed: u64) -> Result<()> {
    let tensors = random_diffusion_tensors(&sdar_tensor_manifest(cfg), seed, DType::F32, &Device::Cpu)?;
    let eos = cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default();
    write_model_dir(dir, &tensors, serde_json::to_value(cfg).expect("config serialises"), "SDARForCausalLM", &eos)
}

/// Writes a LLaDA model directory with deterministic random f32 weights in the released layout.
pub fn write_random_llada(dir: &Path, cfg: &LladaConfig, seed: u64) -> Result<()> {
    let tensors = random_diffusion_tensors(&llada_tensor_manifest(cfg), seed, DType::F32, &Device::Cpu)?;
    let eos = cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default();
    write_model_dir(dir, &tensors, serde_json::to_value(cfg).expect("config serialises"), "LLaDAModelLM", &eos)
}

/// Writes a Dream model directory with deterministic random f32 weights in the released layout.
pub fn write_random_dream(dir: &Path, cfg: &DreamConfig, seed: u64) -> Result<()> {
    let tensors = random_diffusion_tensors(&dream_tensor_manifest(cfg), seed, DType::F32, &Device::Cpu)?;
    let eos = cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default();
    write_model_dir(dir, &tensors, serde_json::to_value(cfg).expect("config serialises"), "DreamModel", &eos)
}

/// Every tensor of a LLaDA2.0 checkpoint (Ling-2.0 names: fused `query_key_value`, per-head
/// q/k norms, dense MLP in the first layers, router + expert bias + per-expert SwiGLUs + shared
/// expert in the rest), as in the released safetensors.
pub fn llada2_tensor_manifest(cfg: &Llada2Config) -> Vec<(String, Vec<usize>)> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim());
    let (nh, nkv) = (cfg.num_attention_heads, cfg.kv_heads());
    let mut m = vec![("model.word_embeddings.weight".to_string(), vec![cfg.vocab_size, h])];
    let swiglu = |m: &mut Vec<(String, Vec<usize>)>, p: &str, width: usize| {
        m.push((format!("{p}.gate_proj.weight"), vec![width, h]));
        m.push((format!("{p}.up_proj.weight"), vec![width, h]));
        m.push((format!("{p}.down_proj.weight"), vec![h, width]));
    };
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        m.push((format!("{p}.input_layernorm.weight"), vec![h]));
        m.push((format!("{p}.attention.query_key_value.weight"), vec![(nh + 2 * nkv) * hd, h]));
        m.push((format!("{p}.attention.query_layernorm.weight"), vec![hd]));
        m.push((format!("{p}.attention.key_layernorm.weight"), vec![hd]));
        m.push((format!("{p}.attention.dense.weight"), vec![h, nh * hd]));
        m.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        if l < cfg.first_k_dense_replace {
            swiglu(&mut m, &format!("{p}.mlp"), cfg.intermediate_size);
        } else {
            m.push((format!("{p}.mlp.gate.weight"), vec![cfg.num_experts, h]));
            m.push((format!("{p}.mlp.gate.expert_bias"), vec![cfg.num_experts]));
            for e in 0..cfg.num_experts {
                swiglu(&mut m, &format!("{p}.mlp.experts.{e}"), cfg.moe_intermediate_size);
            }
            swiglu(&mut m, &format!("{p}.mlp.shared_experts"), cfg.moe_intermediate_size * cfg.num_shared_experts);
        }
    }
    m.push(("model.norm.weight".to_string(), vec![h]));
    m.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    m
}

/// Writes a LLaDA2.0 model directory with deterministic random f32 weights in the released
/// layout. The expert biases are spread wide enough (σ 0.2) to change some routing choices.
pub fn write_random_llada2(dir: &Path, cfg: &Llada2Config, seed: u64) -> Result<()> {
    let manifest = llada2_tensor_manifest(cfg);
    let mut tensors = random_diffusion_tensors(&manifest, seed, DType::F32, &Device::Cpu)?;
    let mut rng = SplitMix(seed ^ 0xB1A5);
    for (name, shape) in manifest.iter().filter(|(n, _)| n.ends_with("expert_bias")) {
        let v: Vec<f32> = (0..shape[0]).map(|_| 0.2 * rng.normal()).collect();
        tensors.insert(name.clone(), Tensor::from_vec(v, shape[0], &Device::Cpu)?);
    }
    write_model_dir(dir, &tensors, serde_json::to_value(cfg).expect("config serialises"), "LLaDA2MoeModelLM", &cfg.eos_ids())
}

/// A tiny LLaDA2.0 config for tests: 3 layers (the first dense), GQA 4:2 × 16 with RoPE on 8
/// dims, 8 experts in 4 groups (2 kept), 2 per token, one shared expert, block 4, mask = the
/// last id.
pub fn tiny_llada2_config(vocab_size: usize) -> Llada2Config {
    Llada2Config {
        vocab_size,
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(16),
        num_experts: 8,
        num_experts_per_tok: 2,
        n_group: 4,
        topk_group: 2,
        moe_intermediate_size: 16,
        rope_theta: 10_000.0,
        max_position_embeddings: 512,
        mask_token_id: Some(vocab_size as u32 - 1),
        block_size: Some(4),
        eos_token_id: None,
        // The release's router, norms and switches.
        ..Llada2Config::llada2_mini()
    }
}

/// A tiny SDAR config for tests: 2 layers, GQA 4:2 × 16, block 8, mask = the last id.
pub fn tiny_sdar_config(vocab_size: usize) -> SdarConfig {
    SdarConfig {
        vocab_size,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(16),
        max_position_embeddings: 512,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        attention_bias: false,
        block_size: Some(8),
        mask_token_id: Some(vocab_size as u32 - 1),
        rope_scaling: None,
        hidden_act: Some("silu".into()),
        bos_token_id: None,
        eos_token_id: None,
        model_type: "sdar".into(),
        // Dense, as SDAR-8B.
        ..SdarConfig::sdar_8b_chat_b32()
    }
}

/// A tiny SDAR MoE config (`sdar_moe`, Qwen3-MoE layers): 3 layers, layer 1 dense
/// (`mlp_only_layers`), 8 experts of width 16, 2 per token, renormalised.
pub fn tiny_sdar_moe_config(vocab_size: usize) -> SdarConfig {
    SdarConfig {
        num_hidden_layers: 3,
        num_experts: Some(8),
        num_experts_per_tok: Some(2),
        moe_intermediate_size: Some(16),
        norm_topk_prob: true,
        decoder_sparse_step: Some(1),
        mlp_only_layers: vec![1],
        block_size: Some(4),
        model_type: "sdar_moe".into(),
        ..tiny_sdar_config(vocab_size)
    }
}

/// A tiny LLaDA config for tests: 2 layers, 4 heads over 2 kv heads (GQA, which the real
/// LLaDA-8B does not use but the loader takes), mask = the last id.
pub fn tiny_llada_config(vocab_size: usize) -> LladaConfig {
    LladaConfig {
        d_model: 64,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: Some(2),
        mlp_hidden_size: 128,
        vocab_size,
        embedding_size: Some(vocab_size),
        max_sequence_length: 512,
        rope_theta: 10_000.0,
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
        mask_token_id: Some(vocab_size as u32 - 1),
        bos_token_id: None,
        eos_token_id: None,
        pad_token_id: None,
        model_type: "llada".into(),
    }
}

/// A tiny Dream config for tests: 2 layers, GQA 4:2 × 16, mask = the last id.
pub fn tiny_dream_config(vocab_size: usize) -> DreamConfig {
    DreamConfig {
        vocab_size,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: None,
        max_position_embeddings: 512,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        use_sliding_window: Some(false),
        rope_scaling: None,
        hidden_act: Some("silu".into()),
        mask_token_id: Some(vocab_size as u32 - 1),
        bos_token_id: None,
        eos_token_id: None,
        pad_token_id: None,
        model_type: "Dream".into(),
    }
}

/// Small deterministic normal generator (Box–Muller over SplitMix64), so test weights do not
/// depend on the `rand` crate's algorithm choices across versions.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

/// Trains a byte-level BPE tokenizer (GPT-2 style: any byte sequence round-trips) on `texts`
/// with the `tokenizers` library. `special` tokens get the first ids (e.g. `<|endoftext|>` = 0).
pub fn train_byte_level_bpe(texts: &[String], vocab_size: usize, special: &[&str]) -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper};
    use tokenizers::{TokenizerBuilder, TokenizerImpl};
    let err = |e: tokenizers::Error| Error::Tokenizer(e.to_string());
    let mut trainer: tokenizers::models::TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(special.iter().map(|s| AddedToken::from(s.to_string(), true)).collect())
        .build()
        .into();
    let mut tok: TokenizerImpl<ModelWrapper, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper> = TokenizerBuilder::new()
        .with_model(BPE::default().into())
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
        .with_decoder(Some(ByteLevel::default().into()))
        .with_post_processor(Some(ByteLevel::new(false, true, true).into()))
        .build()
        .map_err(err)?;
    tok.train(&mut trainer, texts.iter()).map_err(err)?;
    Ok(tokenizers::Tokenizer::from(tok))
}

/// The HTML of "The Rust Programming Language" shipped with the toolchain's rust-docs
/// component (MIT OR Apache-2.0): `$(rustc --print sysroot)/share/doc/rust/html/book`.
pub fn rust_book_dir() -> Result<std::path::PathBuf> {
    let out = std::process::Command::new("rustc").args(["--print", "sysroot"]).output().map_err(|source| Error::Io { path: "rustc".into(), source })?;
    Ok(std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("share/doc/rust/html/book"))
}

/// The prose of every chapter page of the book (the `<main>` element, tags stripped), in file
/// name order, chapters of at least 200 words. Chapter `i` with `i % 20 == 7` is the held-out
/// split of `tools/train/make_corpus.py`.
pub fn rust_book_chapters(dir: &Path) -> Result<Vec<String>> {
    let io = |source| Error::Io { path: dir.to_path_buf(), source };
    let mut pages: Vec<std::path::PathBuf> =
        std::fs::read_dir(dir).map_err(io)?.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "html")).collect();
    pages.sort();
    let mut out = Vec::new();
    for p in pages {
        let html = std::fs::read_to_string(&p).map_err(|source| Error::Io { path: p.clone(), source })?;
        let Some(start) = html.find("<main>") else {
            continue;
        };
        let end = html[start..].find("</main>").map_or(html.len(), |e| start + e);
        let text = strip_tags(&html[start..end]);
        if text.split_whitespace().count() > 200 {
            out.push(text);
        }
    }
    Ok(out)
}

fn strip_tags(html: &str) -> String {
    let mut text = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            _ if !in_tag => text.push(c),
            _ => {}
        }
    }
    let text = text.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&#39;", "'").replace("&#x27;", "'").replace("&amp;", "&");
    // Collapse runs of blank lines left by the markup.
    let mut out = String::new();
    let mut blank = 0;
    for line in text.lines() {
        if line.trim().is_empty() {
            blank += 1;
            if blank == 1 {
                out.push('\n');
            }
        } else {
            blank = 0;
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
    out
}

/// Every position's f32 logits of one canvas run whole through a diffusion model's paged path
/// (block-causal blocks of `block` from position 0 — bidirectional when `block` covers it — one
/// cache slot, pages of 4 positions), on the model's device: how the parity tests compare a
/// model with a reference that runs the canvas without a cache.
pub fn canvas_logits(model: &dyn crate::diffusion::models::DiffusionModel, ids: &[u32], block: usize) -> Result<Vec<Vec<f32>>> {
    use crate::ops::{AttnMask, PagedBatch, PagedBatchHost};
    let (spec, dev, n) = (model.spec(), model.device(), ids.len());
    let pages = n.div_ceil(4);
    let mut kv_mgr = crate::kv::KvManager::new(pages, 4, 1);
    let kv = crate::kv::KvStore::new(spec.num_layers, pages, 4, spec.num_kv_heads, spec.head_dim, spec.dtype, dev)?;
    let id = crate::RequestId(0);
    if !kv_mgr.reserve(id, n) {
        return Err(Error::InvalidOption(format!("{n} positions do not fit {pages} pages")));
    }
    let mut host = PagedBatchHost::new();
    host.push_row(&kv_mgr.tables(id).expect("reserved")[0], n, n, None);
    let batch = PagedBatch::new(host, 4, AttnMask::BlockCausal(block), spec.num_kv_heads * spec.head_dim, dev)?;
    let positions = Tensor::from_vec((0..n as u32).collect::<Vec<_>>(), n, dev)?;
    let h = model.embed(&Tensor::from_vec(ids.to_vec(), n, dev)?)?;
    let h = model.forward(&h, &model.rope(&positions)?, &batch, &kv)?;
    Ok(model.head(&h)?.to_vec2()?)
}

/// ‖a − b‖ / ‖b‖ of a computed row against its float64 reference.
pub fn relative_error(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum::<f64>().sqrt() / b.iter().map(|y| y * y).sum::<f64>().sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The released shapes' parameter counts (the vendor's 16 B and 100 B): a manifest built
    /// from a wrong field would not reach them.
    #[test]
    fn llada2_shapes_hold_the_released_parameter_counts() {
        let total = |cfg: &Llada2Config| llada2_tensor_manifest(cfg).iter().map(|(_, s)| s.iter().product::<usize>() as f64).sum::<f64>() / 1e9;
        let (mini, flash) = (total(&Llada2Config::llada2_mini()), total(&Llada2Config::llada2_flash()));
        assert!((mini - 16.26).abs() < 0.05, "mini: {mini} B");
        assert!((flash - 102.89).abs() < 0.1, "flash: {flash} B");
    }

    /// Lazy random weights are the same tensor whenever and wherever a name is read.
    #[test]
    fn lazy_random_weights_depend_on_the_name_only() {
        let manifest = vec![("a.weight".to_string(), vec![3, 4]), ("b.weight".to_string(), vec![4])];
        let w = lazy_random_weights(&manifest, 9, DType::F32, &Device::Cpu);
        let (a1, b) = (w.get((3, 4), "a.weight").unwrap(), w.get(4, "b.weight").unwrap());
        let a2 = lazy_random_weights(&manifest, 9, DType::F32, &Device::Cpu).get((3, 4), "a.weight").unwrap();
        assert_eq!(a1.to_vec2::<f32>().unwrap(), a2.to_vec2::<f32>().unwrap());
        assert_ne!(a1.flatten_all().unwrap().narrow(0, 0, 4).unwrap().to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        assert!(w.contains("b.weight") && !w.contains("c.weight") && w.get(4, "c.weight").is_err());
    }
}
