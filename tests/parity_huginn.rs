//! Huginn against its float64 reference (`tools/reference/huginn_ref.py`, fixtures by
//! `make_huginn_fixtures.py`): a tiny random Huginn (prelude, recurrent core with the adapter,
//! coda, sandwich norms, q/k biases, interleaved RoPE, padded tied head) served at full depth
//! with depth-indexed K/V — every recurrence's keys kept, as upstream's cache keys them — at the
//! configured recurrences and at fewer. Greedy tokens equal the reference's, and the log-probability
//! the engine reports for each of them, and for a teacher-forced sequence the model does not
//! favour (whose log-probabilities weigh the whole logit row), is the reference's to 2e-5 relative:
//! every decode step's logits, through the KV cache, not only the first. And depth-batched decodes
//! whose tokens exit by the latent difference over the shared and last-exited layouts: every token
//! and every token's recurrences as the reference's.

mod common;
use common::weight_abs_sum;
use ponder::testing::{tiny_huginn_config, write_random_huginn};
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind};
use std::collections::HashMap;
use std::path::Path;

const VOCAB: usize = 97;
/// f32 against float64, relative to the log-probability (plus an absolute floor).
const TOLERANCE: f64 = 2e-5;
/// Seed of the tiny model whose greedy output varies most over the fixture's prompts.
const SEED: u64 = 4;

/// The fixture's models: the tiny Huginn at its configured 6 recurrences (`huginn`) and the same
/// weights served at 2 (`huginn-r2`). The random checkpoint's q/k biases are tiny (N(0, 0.02²));
/// they are replaced by larger values here so that the reference checks where they are added.
fn write_models(root: &Path) {
    let dir = root.join("huginn");
    write_random_huginn(&dir, &tiny_huginn_config(VOCAB), SEED).unwrap();
    let file = dir.join("model.safetensors");
    let mut t: HashMap<String, candle_core::Tensor> = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    let mut names: Vec<String> = t.keys().filter(|n| n.ends_with("qk_bias")).cloned().collect();
    names.sort();
    for (layer, name) in names.iter().enumerate() {
        let shape = t[name].dims().to_vec();
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| 0.5 * ((i * 7 + layer * 13) as f32 * 0.37).sin()).collect();
        t.insert(name.clone(), candle_core::Tensor::from_vec(values, shape, &candle_core::Device::Cpu).unwrap());
    }
    candle_core::safetensors::save(&t, &file).unwrap();
    let fewer = root.join("huginn-r2");
    std::fs::create_dir_all(&fewer).unwrap();
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(dir.join(f), fewer.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["max_steps"] = 2.into();
    std::fs::write(fewer.join("config.json"), cfg.to_string()).unwrap();
}

/// Writes the checkpoints the fixtures are made from (run before the Python script).
#[test]
#[ignore]
fn write_reference_models() {
    write_models(&Path::new(env!("CARGO_MANIFEST_DIR")).join("target/reference-models"));
}

#[derive(serde::Deserialize)]
struct Case {
    model: String,
    prompt: Vec<u32>,
    steps: usize,
    tokens: Vec<u32>,
    logprobs: Vec<f64>,
    forced: Vec<u32>,
    forced_logprobs: Vec<f64>,
}

#[test]
fn greedy_decoding_matches_the_float64_reference() {
    let doc: serde_json::Value = serde_json::from_str(include_str!("fixtures/tiny_huginn_reference.json")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_models(tmp.path());
    let want = doc["weight_abs_sum"].as_f64().unwrap();
    let got = weight_abs_sum(&tmp.path().join("huginn"));
    assert!((got - want).abs() <= 1e-9 * want, "the fixture was made from other weights ({got} vs {want})");
    for name in ["huginn", "huginn-r2"] {
        common::assert_fixture_config(&tmp.path().join(name), &doc["configs"][name]);
    }
    let cases: Vec<Case> = serde_json::from_value(doc["cases"].clone()).unwrap();
    assert!(cases.len() >= 6 && cases.iter().any(|c| c.steps == 2));
    let distinct: std::collections::HashSet<u32> = cases.iter().flat_map(|c| c.tokens.iter().copied()).collect();
    assert!(distinct.len() >= 5, "the fixture's tokens hardly vary ({distinct:?}): pick another seed");
    for c in cases {
        let label = format!("{} (r {}) prompt {:?}", c.model, c.steps, c.prompt);
        let dir = tmp.path().join(&c.model);
        let mut engine = EngineBuilder::new(&dir).block_size(4).looped(|o| o.kv_layout(KvLayoutKind::DepthIndexed)).build().unwrap();
        assert_eq!(engine.spec().looped().unwrap().max_steps, c.steps, "{label}");
        let greedy = engine.generate([c.prompt.clone()], &GenerationParams::greedy(c.tokens.len())).unwrap().remove(0).unwrap();
        assert_eq!(greedy.token_ids, c.tokens, "{label}: greedy tokens");
        for (what, tokens, want) in [("greedy", &c.tokens, &c.logprobs), ("forced", &c.forced, &c.forced_logprobs)] {
            common::assert_forced_logprobs(&mut engine, &c.prompt, tokens, want, TOLERANCE, &format!("{label}: {what}"));
        }
    }
}

#[test]
fn latent_difference_exits_match_the_reference_token_by_token() {
    use ponder::looped::gate::LatentDiff;
    use ponder::SchedulerKind;
    let doc: serde_json::Value = serde_json::from_str(include_str!("fixtures/tiny_huginn_reference.json")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_models(tmp.path());
    let gated = doc["gated"].as_array().unwrap();
    assert!(gated.len() >= 12, "{} gated decodes", gated.len());
    let depths: std::collections::HashSet<u64> =
        gated.iter().flat_map(|g| g["depths"].as_array().unwrap().iter().skip(1).map(|d| d.as_u64().unwrap())).collect();
    assert!(depths.len() >= 3, "decode tokens exit at {depths:?} only");
    for g in gated {
        let prompt: Vec<u32> = serde_json::from_value(g["prompt"].clone()).unwrap();
        let (want_tokens, want_depths): (Vec<u32>, Vec<u32>) =
            (serde_json::from_value(g["tokens"].clone()).unwrap(), serde_json::from_value(g["depths"].clone()).unwrap());
        let threshold = g["threshold"].as_f64().unwrap() as f32;
        let layout = match g["layout"].as_str().unwrap() {
            "shared" => KvLayoutKind::Shared,
            "last_exited" => KvLayoutKind::LastExited,
            other => panic!("layout {other}"),
        };
        let gate = LatentDiff::new(threshold, 1, 6).unwrap();
        let mut engine = EngineBuilder::new(tmp.path().join("huginn"))
            .block_size(4)
            .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(layout).exit_gate(gate))
            .build()
            .unwrap();
        engine.add_request(prompt.clone(), GenerationParams::greedy(want_tokens.len())).unwrap();
        let (tokens, steps) = common::tokens_and_steps(&mut engine);
        let label = format!("prompt {prompt:?} threshold {threshold} {:?}", layout);
        assert_eq!(tokens, want_tokens, "{label}: tokens");
        assert_eq!(steps, want_depths, "{label}: recurrences per token");
        // The same tokens teacher-forced through the same exits: every token's log-probability,
        // which sees the K/V each layout keeps (a wrong copy shows here).
        let want_logprobs: Vec<f64> = serde_json::from_value(g["logprobs"].clone()).unwrap();
        common::assert_forced_logprobs(&mut engine, &prompt, &want_tokens, &want_logprobs, TOLERANCE, &label);
    }
}
