//! FP8 weights on the CPU, every family: an engine built with `Quantization::Fp8` stores
//! exactly the linear layers it names in E4M3 (its reported weight bytes equal those counted
//! from the checkpoint), and decodes exactly as a dense engine over a checkpoint whose same
//! layers were quantized and dequantized — the reference every FP8 path answers to.

mod common;

use candle_core::{DType, Device, Tensor};
use ponder::quant::{Fp8Weight, Quantization};
use ponder::{Engine, EngineBuilder, GenerationParams, SamplingParams};
use std::collections::HashMap;
use std::path::Path;

/// The layers `Quantization::Fp8` stores in E4M3, by tensor name across the families' layouts:
/// attention projections and MLPs (dense and shared experts, Huginn's adapter). Routed experts,
/// routers, embeddings, norms, gates and LM heads stay as they are.
fn quantized(name: &str) -> bool {
    const LINEARS: [&str; 16] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "attn.Wqkv",
        "attn.proj",
        "mlp.fc",
        "mlp.proj",
        "transformer.adapter",
        "attn_out",
        "ff_proj",
        "attention.query_key_value",
        "attention.dense",
    ];
    let Some(stem) = name.strip_suffix(".weight") else { return false };
    if stem.contains(".mlp.experts.") {
        return false;
    }
    // LLaDA's block MLP output is `blocks.N.ff_out`; its LM head is `transformer.ff_out`.
    LINEARS.iter().any(|l| stem.ends_with(&format!(".{l}")) || stem == *l) || (stem.contains(".blocks.") && stem.ends_with(".ff_out"))
}

fn tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

/// A copy of the checkpoint at `dir` whose quantized layers hold their FP8 values dequantized
/// (f32); every other file and tensor unchanged.
fn dequantized_copy(dir: &Path, to: &Path) -> usize {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
    let mut n = 0;
    let map: HashMap<String, Tensor> = tensors(dir)
        .into_iter()
        .map(|(name, t)| {
            if quantized(&name) {
                n += 1;
                let t = Fp8Weight::quantize(&t).unwrap().dequantize(DType::F32).unwrap();
                (name, t)
            } else {
                (name, t)
            }
        })
        .collect();
    candle_core::safetensors::save(&map, to.join("model.safetensors")).unwrap();
    n
}

/// Bytes the engine should hold: a byte a value and an f32 scale a row for the quantized
/// layers, four bytes a value for the rest (the CPU engines run in f32).
fn expected_bytes(dir: &Path, fp8: bool) -> u64 {
    tensors(dir)
        .iter()
        .map(|(name, t)| match fp8 && quantized(name) {
            true => (t.elem_count() + 4 * t.dims()[0]) as u64,
            false => 4 * t.elem_count() as u64,
        })
        .sum()
}

fn weight_bytes(e: &Engine) -> u64 {
    match e.spec() {
        ponder::engine::ModelSpec::Looped(s) => s.weight_bytes,
        ponder::engine::ModelSpec::Diffusion(s) => s.weight_bytes,
    }
}

fn decode(e: &mut Engine, looped: bool) -> Vec<(Vec<u32>, Vec<f32>)> {
    let params = GenerationParams {
        sampling: SamplingParams { temperature: 1.0, top_k: None, top_p: None, seed: Some(11) },
        logprobs: looped.then_some(0),
        ignore_eos: true,
        ..GenerationParams::greedy(16)
    };
    let prompts = if looped { common::prompts(3, 5) } else { common::diffusion_prompts(3, 5) };
    e.generate(prompts, &params).unwrap().into_iter().map(|o| o.unwrap()).map(|o| (o.token_ids, o.logprobs)).collect()
}

#[test]
fn fp8_engines_store_the_named_layers_and_decode_as_their_dequantized_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, dir) in common::family_checkpoints(tmp.path()) {
        let looped = matches!(family, "ouro" | "huginn");
        let reference = tmp.path().join(format!("{family}_dequantized"));
        let layers = dequantized_copy(&dir, &reference);
        assert!(layers >= 4, "{family}: {layers} quantized layers");

        let mut fp8 = EngineBuilder::new(&dir).quantization(Quantization::Fp8).max_num_seqs(4).build().unwrap();
        let mut dense = EngineBuilder::new(&dir).max_num_seqs(4).build().unwrap();
        let mut deq = EngineBuilder::new(&reference).max_num_seqs(4).build().unwrap();
        assert_eq!(weight_bytes(&dense), expected_bytes(&dir, false), "{family}: dense bytes");
        assert_eq!(weight_bytes(&fp8), expected_bytes(&dir, true), "{family}: FP8 bytes (which layers are quantized)");

        let (got, want, plain) = (decode(&mut fp8, looped), decode(&mut deq, looped), decode(&mut dense, looped));
        assert_eq!(got, want, "{family}: FP8 against the dequantized reference");
        if looped {
            // On the dense engine's tokens (teacher forcing), their log-probabilities move a
            // little under FP8.
            let prompts = common::prompts(3, 5);
            let mut moved = 0f32;
            for (p, (tokens, lps)) in prompts.iter().zip(&plain) {
                let forced = GenerationParams { forced_tokens: tokens.clone(), logprobs: Some(0), ignore_eos: true, ..GenerationParams::greedy(tokens.len()) };
                let o = fp8.generate([p.clone()], &forced).unwrap().remove(0).unwrap();
                assert_eq!(&o.token_ids, tokens, "{family}");
                moved = o.logprobs.iter().zip(lps).map(|(a, b)| (a - b).abs()).fold(moved, f32::max);
            }
            assert!(moved > 0.0 && moved < 0.5, "{family}: logprobs moved by at most {moved}");
        }
        common::assert_kv_empty(&fp8);
    }
}

#[test]
fn fp8_is_an_option_of_the_checkpoint_builder_by_name() {
    assert_eq!("fp8".parse::<Quantization>().unwrap(), Quantization::Fp8);
    assert_eq!("none".parse::<Quantization>().unwrap(), Quantization::None);
    assert!(matches!("int4".parse::<Quantization>(), Err(ponder::Error::InvalidOption(_))));
}
