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
/// attention projections and MLPs (dense, routed and shared experts, Huginn's adapter).
/// Routers, embeddings, norms, gates and LM heads stay as they are.
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

/// `w` `[out, in]` quantized with one scale per `block` tile (partial edge tiles allowed): the
/// E4M3 values and the scales `[ceil(out / b0), ceil(in / b1)]`.
fn block_quantize(w: &Tensor, block: (usize, usize)) -> (Tensor, Tensor) {
    let (out, inp) = w.dims2().unwrap();
    let v = w.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    let (rt, ct) = (out.div_ceil(block.0), inp.div_ceil(block.1));
    let mut scales = vec![1f32; rt * ct];
    for (t, s) in scales.iter_mut().enumerate() {
        let (r0, c0) = ((t / ct) * block.0, (t % ct) * block.1);
        let amax = (r0..(r0 + block.0).min(out)).flat_map(|r| v[r][c0..(c0 + block.1).min(inp)].iter()).fold(0f32, |m, x| m.max(x.abs()));
        if amax > 0.0 {
            *s = amax / 448.0;
        }
    }
    let q: Vec<f32> = (0..out * inp).map(|i| (v[i / inp][i % inp] / scales[(i / inp / block.0) * ct + (i % inp) / block.1]).clamp(-448.0, 448.0)).collect();
    let q = Tensor::from_vec(q, (out, inp), &Device::Cpu).unwrap().to_dtype(DType::F8E4M3).unwrap();
    (q, Tensor::from_vec(scales, (rt, ct), &Device::Cpu).unwrap())
}

/// The checkpoint at `dir` re-stored as an FP8 release would ship it (`layout`: "channel" for
/// compressed-tensors with a scale per output channel, "block" for fine-grained FP8 with
/// 16 × 16 tiles), and beside it the dense checkpoint of what those FP8 values stand for.
fn fp8_release(dir: &Path, fp8_dir: &Path, dense_dir: &Path, layout: &str) {
    for d in [fp8_dir, dense_dir] {
        std::fs::create_dir_all(d).unwrap();
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.file_name().unwrap() != "model.safetensors" {
                std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
            }
        }
    }
    let (mut fp8, mut dense) = (HashMap::new(), HashMap::new());
    for (name, t) in tensors(dir) {
        if !quantized(&name) {
            fp8.insert(name.clone(), t.clone());
            dense.insert(name, t);
            continue;
        }
        let (data, scale, back) = if layout == "channel" {
            let q = Fp8Weight::quantize(&t).unwrap();
            let ponder::quant::Fp8Scale::PerChannel(s) = q.scale() else { unreachable!() };
            (q.data().clone(), s.unsqueeze(1).unwrap(), q.dequantize(DType::F32).unwrap())
        } else {
            let (data, scale) = block_quantize(&t, (16, 16));
            let back = Fp8Weight::from_parts(data.clone(), ponder::quant::Fp8Scale::Block { scale: scale.clone(), block: (16, 16) }).unwrap();
            (data, scale, back.dequantize(DType::F32).unwrap())
        };
        let suffix = if layout == "channel" { "_scale" } else { "_scale_inv" };
        fp8.insert(format!("{name}{suffix}"), scale);
        fp8.insert(name.clone(), data);
        dense.insert(name, back);
    }
    candle_core::safetensors::save(&fp8, fp8_dir.join("model.safetensors")).unwrap();
    candle_core::safetensors::save(&dense, dense_dir.join("model.safetensors")).unwrap();
    let config_path = fp8_dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["quantization_config"] = if layout == "channel" {
        serde_json::json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}}, "ignore": ["lm_head"]})
    } else {
        serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]})
    };
    std::fs::write(&config_path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

#[test]
fn fp8_checkpoints_load_in_both_layouts_and_decode_as_what_their_values_stand_for() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, dir) in common::family_checkpoints(tmp.path()) {
        let looped = matches!(family, "ouro" | "huginn");
        for layout in ["channel", "block"] {
            let (fp8_dir, dense_dir) = (tmp.path().join(format!("{family}_{layout}_fp8")), tmp.path().join(format!("{family}_{layout}_dense")));
            fp8_release(&dir, &fp8_dir, &dense_dir, layout);
            let mut fp8 = EngineBuilder::new(&fp8_dir).max_num_seqs(4).build().unwrap_or_else(|e| panic!("{family} {layout}: {e}"));
            let mut dense = EngineBuilder::new(&dense_dir).max_num_seqs(4).build().unwrap();
            // Stored as shipped: a byte a value plus the scales, which are f32 here. Routed
            // experts shipped in FP8 are dequantized at load (no per-block expert storage yet).
            let stored = tensors(&fp8_dir);
            let routed = |n: &str| n.contains(".mlp.experts.");
            let scale = |n: &str| n.ends_with("_scale") || n.ends_with("_scale_inv");
            let bytes: u64 = stored
                .iter()
                .map(|(n, t)| match (quantized(n), scale(n), routed(n)) {
                    (_, true, true) => 0,
                    (true, _, true) => 4 * t.elem_count() as u64,
                    (true, _, false) => t.elem_count() as u64,
                    _ => 4 * t.elem_count() as u64,
                })
                .sum();
            assert_eq!(weight_bytes(&fp8), bytes, "{family} {layout}");
            assert_eq!(decode(&mut fp8, looped), decode(&mut dense, looped), "{family} {layout}");
        }
    }
}

#[test]
fn a_broken_fp8_checkpoint_is_a_typed_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ouro");
    ponder::testing::write_random_ouro(&dir, &ponder::testing::tiny_ouro_config(common::VOCAB), 1).unwrap();
    let (fp8_dir, dense_dir) = (tmp.path().join("fp8"), tmp.path().join("dense"));
    fp8_release(&dir, &fp8_dir, &dense_dir, "channel");
    let original = tensors(&fp8_dir);
    let rewrite = |map: &HashMap<String, Tensor>| candle_core::safetensors::save(map, fp8_dir.join("model.safetensors")).unwrap();
    let expect = |what: &str, map: HashMap<String, Tensor>| {
        rewrite(&map);
        let err = EngineBuilder::new(&fp8_dir).build().err().unwrap_or_else(|| panic!("{what}: built"));
        assert!(matches!(err, ponder::Error::BadTensor { .. }), "{what}: {err:?}");
    };
    let name = "model.layers.0.self_attn.o_proj.weight";
    let mut m = original.clone();
    m.remove(&format!("{name}_scale"));
    expect("a missing scale", m);
    let mut m = original.clone();
    m.insert(format!("{name}_scale"), Tensor::ones((3, 1), DType::F32, &Device::Cpu).unwrap());
    expect("a scale of the wrong shape", m);
    let mut m = original.clone();
    let norm = "model.layers.0.input_layernorm.weight";
    let n = m[norm].to_dtype(DType::F8E4M3).unwrap();
    m.insert(norm.into(), n);
    expect("a norm stored in FP8", m);
    rewrite(&original);
    assert!(EngineBuilder::new(&fp8_dir).build().is_ok(), "the unbroken checkpoint builds");
}

/// W8A8 (each token's activations quantized to E4M3 with its own scale, as the FP8 GEMM
/// multiplies them) is a property of each row, so batching does not change it: every family
/// decodes the same tokens batched as one request at a time (log-probabilities within 1e-5), and
/// the KV pool ends empty. The
/// activations' rounding moves the looped models' log-probabilities against FP8 weights alone.
#[test]
fn w8a8_decodes_every_request_as_alone_in_every_family() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, dir) in common::family_checkpoints(tmp.path()) {
        let looped = matches!(family, "ouro" | "huginn");
        let build = |kernels: &str| EngineBuilder::new(&dir).quantization(Quantization::Fp8).kernels(kernels.parse().unwrap()).max_num_seqs(4).build().unwrap();
        let mut batched = build("fp8=w8a8");
        let together = decode(&mut batched, looped);
        common::assert_kv_empty(&batched);
        let prompts = if looped { common::prompts(3, 5) } else { common::diffusion_prompts(3, 5) };
        let params = GenerationParams {
            sampling: SamplingParams { temperature: 1.0, top_k: None, top_p: None, seed: Some(11) },
            logprobs: looped.then_some(0),
            ignore_eos: true,
            ..GenerationParams::greedy(16)
        };
        let mut single = build("fp8=w8a8");
        for (p, want) in prompts.iter().zip(&together) {
            let o = single.generate([p.clone()], &params).unwrap().remove(0).unwrap();
            // Tokens exactly; log-probabilities to the matmul's summation order, which the
            // CPU's kernels choose by the number of rows.
            assert_eq!(o.token_ids, want.0, "{family}: alone against batched");
            assert!(
                o.logprobs.len() == want.1.len() && o.logprobs.iter().zip(&want.1).all(|(a, b)| (a - b).abs() < 1e-5),
                "{family}: {:?} vs {:?}",
                o.logprobs,
                want.1
            );
        }
        if looped {
            let weight_only = decode(&mut build("fp8=weight-only"), looped);
            let moved = together.iter().zip(&weight_only).flat_map(|(a, b)| a.1.iter().zip(&b.1)).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(moved > 0.0, "{family}: the activations' rounding shows in the log-probabilities");
        }
    }
}
