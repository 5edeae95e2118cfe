//! The MoE diffusion models against independent float64 references on tiny random checkpoints
//! in their released layouts (fixtures by `tools/reference/make_llada2_fixtures.py`): LLaDA2.0
//! (`llada2_moe`, `llada2_ref.py`) and SDAR's Qwen3-MoE layout (`sdar_moe`, `sdar_ref.py`). Every
//! position's logits of a block-causal canvas within 1e-5 relative (f32, CPU, through the
//! paged path), the router's chosen experts at every MoE layer identical, and greedy
//! block-diffusion decoding token for token: LLaDA2.0 under thresholds (EOS included), the SDAR
//! MoE under thresholds and static counts (`block_diffusion_ref.py`).

mod common;
use candle_core::Tensor;
use common::{fixture_params, fixture_policy};
use ponder::diffusion::models::{self, DenseDiffusion, DiffusionModel};
use ponder::diffusion::Threshold;
use ponder::loader::ModelDir;
use ponder::testing::{canvas_logits, relative_error, tiny_llada2_config, tiny_sdar_moe_config, write_random_llada2, write_random_sdar};
use ponder::{DType, Device, EngineBuilder};
use std::path::Path;

const VOCAB: usize = 97;
const SEED: u64 = 5;

/// Writes the checkpoints the fixtures are made from (run before the Python script).
#[test]
#[ignore]
fn write_reference_models() {
    write_models(&Path::new(env!("CARGO_MANIFEST_DIR")).join("target/reference-models"));
}

fn write_models(root: &Path) {
    write_random_llada2(&root.join("llada2"), &tiny_llada2_config(VOCAB), SEED).unwrap();
    write_random_sdar(&root.join("sdar_moe"), &tiny_sdar_moe_config(VOCAB), SEED).unwrap();
}

fn fixture(family: &str) -> serde_json::Value {
    let text = match family {
        "llada2" => include_str!("fixtures/tiny_llada2_reference.json"),
        _ => include_str!("fixtures/tiny_sdar_moe_reference.json"),
    };
    serde_json::from_str(text).unwrap()
}

fn model_dir(tmp: &Path, family: &str) -> std::path::PathBuf {
    write_models(tmp);
    let dir = tmp.join(family);
    let sum = common::weight_abs_sum(&dir);
    let want = fixture(family)["weight_abs_sum"].as_f64().unwrap();
    assert!((sum - want).abs() <= 1e-9 * want, "{family}: the fixture was made from other weights ({sum} vs {want})");
    common::assert_fixture_config(&dir, &fixture(family)["config"]);
    dir
}

#[test]
fn logits_and_routes_match_the_float64_references() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, model_type, moe_layers) in [("llada2", "llada2_moe", vec![1, 2]), ("sdar_moe", "sdar_moe", vec![0, 2])] {
        let dir = ModelDir::open(model_dir(tmp.path(), family)).unwrap();
        assert_eq!(dir.config.model_type(), model_type);
        let model = models::load(&dir.config, &dir.weights(DType::F32, &Device::Cpu).unwrap()).unwrap();
        assert_eq!(model.spec().model_type, model_type);
        check_forward(&model, family, &moe_layers);
    }
}

/// Every forward case of `family`'s fixture: every position's logits and each MoE layer's experts.
fn check_forward(model: &DenseDiffusion, family: &str, moe_layers: &[usize]) {
    let spec = model.spec().clone();
    assert_eq!((spec.block_length, spec.mask_token_id), (Some(4), VOCAB as u32 - 1));
    let mut exercised: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for case in fixture(family)["forward"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let n = ids.len();
        // Every position's logits: a wrong route at any position of the last MoE layer shows.
        let got = canvas_logits(model, &ids, 4).unwrap();
        let want: Vec<Vec<f64>> = serde_json::from_value(case["logits"].clone()).unwrap();
        assert_eq!(got.len(), n);
        for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = relative_error(g, w);
            assert!(err <= 1e-5, "{family} {ids:?} position {pos}: relative error {err:e}");
        }
        let inputs: Vec<Vec<Vec<f32>>> = serde_json::from_value(case["moe_inputs"].clone()).unwrap();
        let experts: Vec<Vec<Vec<usize>>> = serde_json::from_value(case["experts"].clone()).unwrap();
        assert_eq!(inputs.len(), moe_layers.len());
        for ((x, want), &l) in inputs.iter().zip(&experts).zip(moe_layers) {
            let x = Tensor::from_vec(x.concat(), (n, spec.hidden_size), &Device::Cpu).unwrap();
            let got = model.routed_experts(l, &x).unwrap().expect("a MoE layer");
            assert_eq!(&got, want, "{family} {ids:?}: layer {l}");
        }
        for key in ["changed_without_bias", "changed_without_groups"] {
            if let Some(counts) = case.get(key) {
                *exercised.entry(key).or_insert(0) += counts.as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).sum::<u64>();
            }
        }
        let dense = (0..spec.num_layers).find(|l| !moe_layers.contains(l)).unwrap();
        let x = Tensor::zeros((1, spec.hidden_size), DType::F32, &Device::Cpu).unwrap();
        assert!(model.routed_experts(dense, &x).unwrap().is_none(), "{family}: layer {dense} is dense");
    }
    if family == "llada2" {
        // The fixtures route differently without the selection bias and without the group
        // limit, so both rules are exercised.
        assert!(exercised.len() == 2 && exercised.values().all(|&c| c > 0), "{exercised:?}");
    }
}

#[test]
fn greedy_and_sampled_decoding_match_the_float64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model_dir(tmp.path(), "llada2");
    let cases = fixture("llada2")["generate"].as_array().unwrap().clone();
    let (mut varied, mut ended_on_eos, mut released_default, mut sampled) = (false, false, false, 0);
    for c in cases {
        let prompt: Vec<u32> = serde_json::from_value(c["prompt"].clone()).unwrap();
        let mut want: Vec<u32> = serde_json::from_value(c["tokens"].clone()).unwrap();
        let eos: Vec<u32> = serde_json::from_value(c["eos"].clone()).unwrap();
        let (gen, block, t) = (c["gen"].as_u64().unwrap() as usize, c["block"].as_u64().unwrap() as usize, c["threshold"].as_f64().unwrap() as f32);
        let dir = if eos.is_empty() {
            dir.clone()
        } else {
            // The same weights with an EOS id in the config. The reference returns through the
            // EOS; the engine ends the request on it and streams what came before.
            let d = tmp.path().join("llada2-eos");
            let cfg = ponder::diffusion::models::Llada2Config { eos_token_id: Some(ponder::config::EosIds::Many(eos.clone())), ..tiny_llada2_config(VOCAB) };
            write_random_llada2(&d, &cfg, SEED).unwrap();
            assert_eq!(want.pop().map(|t| eos.contains(&t)), Some(true));
            ended_on_eos = true;
            d
        };
        let mut engine = EngineBuilder::new(&dir)
            .block_size(4)
            .max_num_seqs(1)
            .diffusion(|o| o.block_length(block).unmask_policy(Threshold::new(t).unwrap()))
            .build()
            .unwrap();
        let params = fixture_params(&c, gen);
        sampled += usize::from(!params.sampling.is_greedy());
        let out = engine.generate([prompt.clone()], &params).unwrap().remove(0).unwrap();
        assert_eq!(out.token_ids, want, "prompt {prompt:?} block {block} threshold {t} eos {eos:?} {:?}", params.sampling);
        if t == 0.95 {
            // LLaDA2.0's released threshold, which its spec hands the builder as the default
            // unmask policy (on this tiny model 0.9 decodes the same tokens, so the spec is what
            // is checked).
            assert_eq!(engine.spec().diffusion().unwrap().unmask_threshold, Some(0.95));
            released_default = true;
        }
        assert_eq!(engine.requests().kv().num_used_blocks(), 0);
        varied |= want.iter().any(|&x| x != want[0]);
    }
    assert!(varied, "the reference decodes more than one distinct token");
    assert!(ended_on_eos, "a case ends on EOS");
    assert!(released_default, "a case decodes at the released threshold");
    assert!(sampled >= 3, "sampled decodes: {sampled}");
}

#[test]
fn sdar_moe_block_diffusion_greedy_and_sampled_matches_the_float64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model_dir(tmp.path(), "sdar_moe");
    let cases = fixture("sdar_moe")["generate"].as_array().unwrap().clone();
    assert!(cases.len() >= 12 && cases.iter().any(|c| c["policy"] == "static") && cases.iter().any(|c| c["policy"] == "threshold"));
    assert!(cases.iter().filter(|c| !c["sampling"].is_null()).count() >= 2);
    for c in cases {
        let prompt: Vec<u32> = serde_json::from_value(c["prompt"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(c["tokens"].clone()).unwrap();
        let gen = c["gen"].as_u64().unwrap() as usize;
        let mut engine =
            EngineBuilder::new(&dir).block_size(4).max_num_seqs(1).diffusion(|o| o.block_length(4).unmask_policy_boxed(fixture_policy(&c))).build().unwrap();
        let params = fixture_params(&c, gen);
        let out = engine.generate([prompt.clone()], &params).unwrap().remove(0).unwrap();
        assert_eq!(out.token_ids, want, "prompt {prompt:?} {} {} {:?}", c["policy"], c["value"], params.sampling);
        assert_eq!(engine.requests().kv().num_used_blocks(), 0);
    }
}
