//! LLaDA and Dream decoded as their references decode them: greedy and sampled token sequences
//! through the engine (f32, CPU) equal the float64 reference's (`tools/reference/bidirectional_ref.py`
//! and `diffusion_sampling.py`, fixtures by `make_bidirectional_fixtures.py`) for
//! LLaDA's semi-autoregressive blocks (linear, static and threshold schedules, several block
//! lengths and steps, prompts not a multiple of the block, a shorter last block) and Dream's
//! block schedule and its own sampler (three confidence orders); and LLaDA under Fast-dLLM's
//! prefix and dual caches, whose reference runs a block's later steps on the keys and values its
//! first step left.

mod common;
use common::weight_abs_sum;
use ponder::diffusion::{CanvasCache, Confidence, LinearSchedule, StaticCount, Threshold, UnmaskPolicy};
use ponder::testing::{tiny_dream_config, tiny_llada_config, write_random_dream, write_random_llada};
use ponder::{EngineBuilder, GenerationParams, SamplingParams};
use std::path::Path;

const VOCAB: usize = 97;
/// Seed 11 of 1–12 gave the tiny LLaDA the most varied greedy output (most random tiny LLaDAs
/// decode every masked position to one token: their masks differ only by position).
const SEEDS: [(&str, u64); 2] = [("llada", 11), ("dream", 52)];

fn write_models(root: &Path) {
    write_random_llada(&root.join("llada"), &tiny_llada_config(VOCAB), SEEDS[0].1).unwrap();
    write_random_dream(&root.join("dream"), &tiny_dream_config(VOCAB), SEEDS[1].1).unwrap();
}

/// Writes the checkpoints the fixtures are made from (run before the Python script).
#[test]
#[ignore]
fn write_reference_models() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/reference-models");
    write_models(&root);
}

#[derive(serde::Deserialize)]
struct Case {
    family: String,
    prompt: Vec<u32>,
    gen: usize,
    block: usize,
    steps: usize,
    schedule: String,
    /// Fast-dLLM's cache the decode ran under (`prefix` / `dual`); none: exact.
    #[serde(default)]
    cache: Option<String>,
    tokens: Vec<u32>,
    /// Sampled decodes: the request's sampling parameters (absent: greedy).
    #[serde(default)]
    sampling: Option<Sampling>,
}

#[derive(serde::Deserialize)]
struct Sampling {
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: u64,
}

impl Case {
    fn params(&self) -> GenerationParams {
        let greedy = GenerationParams::greedy(self.gen);
        match &self.sampling {
            None => greedy,
            Some(s) => {
                GenerationParams { sampling: SamplingParams { temperature: s.temperature, top_k: s.top_k, top_p: s.top_p, seed: Some(s.seed) }, ..greedy }
            }
        }
    }
}

#[test]
fn greedy_and_sampled_decoding_match_the_float64_reference() {
    let doc: serde_json::Value = serde_json::from_str(include_str!("fixtures/tiny_bidirectional_reference.json")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_models(tmp.path());
    for (family, _) in SEEDS {
        let want = doc["weight_abs_sum"][family].as_f64().unwrap();
        let got = weight_abs_sum(&tmp.path().join(family));
        assert!((got - want).abs() <= 1e-9 * want, "{family}: the fixture was made from other weights ({got} vs {want})");
        common::assert_fixture_config(&tmp.path().join(family), &doc["configs"][family]);
    }
    let cases: Vec<Case> = serde_json::from_value(doc["cases"].clone()).unwrap();
    assert!(cases.len() >= 12);
    assert!(cases.iter().filter(|c| c.sampling.is_some()).count() >= 6, "sampled decodes of both families");
    assert!(cases.iter().any(|c| c.cache.as_deref() == Some("prefix")) && cases.iter().any(|c| c.cache.as_deref() == Some("dual")));
    for c in cases {
        let label =
            format!("{} {} {:?} block {} steps {} prompt {:?} sampling {:?}", c.family, c.schedule, c.cache, c.block, c.steps, c.prompt, c.params().sampling);
        let cache = match c.cache.as_deref() {
            None => CanvasCache::Exact,
            Some("prefix") => CanvasCache::Prefix,
            Some("dual") => CanvasCache::Dual,
            Some(other) => panic!("cache {other}"),
        };
        let dir = tmp.path().join(&c.family);
        let b = EngineBuilder::new(&dir).block_size(4).max_num_seqs(1);
        let b = match c.schedule.split_once(':') {
            Some(("dream", order)) => {
                let order = match order {
                    "maskgit_plus" => Confidence::Probability,
                    "topk_margin" => Confidence::Margin,
                    "entropy" => Confidence::NegEntropy,
                    other => panic!("order {other}"),
                };
                b.diffusion(|o| o.dream_sampler(c.steps, order))
            }
            _ => {
                let policy: Box<dyn UnmaskPolicy> = match c.schedule.split_once(':') {
                    None => Box::new(LinearSchedule::new(c.steps).unwrap()),
                    Some(("static", n)) => Box::new(StaticCount::new(n.parse().unwrap()).unwrap()),
                    Some(("threshold", t)) => Box::new(Threshold::new(t.parse().unwrap()).unwrap()),
                    other => panic!("schedule {other:?}"),
                };
                b.diffusion(|o| o.block_length(c.block).max_steps_per_block(c.steps).canvas_cache(cache).unmask_policy_boxed(policy))
            }
        };
        let mut engine = b.build().unwrap();
        let out = engine.generate([c.prompt.clone()], &c.params()).unwrap().remove(0).unwrap();
        assert_eq!(out.token_ids, c.tokens, "{label}");
        assert_eq!(engine.requests().kv().num_used_blocks(), 0);
    }
}

/// EOS as the references handle it: once every position up to an EOS is revealed the request
/// ends there, cut before the EOS, its KV freed; the request beside it goes on unchanged.
#[test]
fn a_request_ends_at_its_first_eos_and_frees_its_kv() {
    let doc: serde_json::Value = serde_json::from_str(include_str!("fixtures/tiny_bidirectional_reference.json")).unwrap();
    let cases: Vec<Case> = serde_json::from_value(doc["cases"].clone()).unwrap();
    let c = &cases[0];
    assert_eq!((c.family.as_str(), c.schedule.as_str(), c.block, c.steps), ("llada", "linear", 4, 2));
    // The first token that does not occur before it: the output is cut there.
    let cut = (1..c.tokens.len()).find(|&i| !c.tokens[..i].contains(&c.tokens[i])).expect("a fresh token");
    let eos = c.tokens[cut];
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_llada_config(VOCAB);
    cfg.eos_token_id = Some(ponder::config::EosIds::One(eos));
    write_random_llada(tmp.path(), &cfg, SEEDS[0].1).unwrap();
    let mut engine = EngineBuilder::new(tmp.path())
        .block_size(4)
        .max_num_seqs(2)
        .diffusion(|o| o.block_length(4).max_steps_per_block(2).unmask_policy(LinearSchedule::new(2).unwrap()))
        .build()
        .unwrap();
    let other = vec![30u32, 31, 32];
    let alone = engine.generate([other.clone()], &GenerationParams { ignore_eos: true, ..GenerationParams::greedy(8) }).unwrap().remove(0).unwrap();
    let ids = [c.prompt.clone(), other];
    let params = [GenerationParams::greedy(c.gen), GenerationParams { ignore_eos: true, ..GenerationParams::greedy(8) }];
    let a = engine.add_request(ids[0].clone(), params[0].clone()).unwrap();
    let b = engine.add_request(ids[1].clone(), params[1].clone()).unwrap();
    let (mut tokens, mut finished) = (std::collections::HashMap::new(), std::collections::HashMap::new());
    let mut freed_while_b_runs = false;
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            match ev {
                ponder::Event::Token { id, token, .. } => tokens.entry(id).or_insert_with(Vec::new).push(token),
                ponder::Event::Finished { id, reason, .. } => {
                    finished.insert(id, reason);
                }
            }
        }
        if finished.contains_key(&a) && !finished.contains_key(&b) {
            freed_while_b_runs |= engine.requests().kv().tables(a).is_none();
        }
    }
    assert_eq!(finished[&a], ponder::FinishReason::Eos);
    assert_eq!(tokens[&a], c.tokens[..cut].to_vec(), "cut at the first EOS (token {eos} at {cut})");
    assert!(freed_while_b_runs, "the finished request's KV was freed while the other still ran");
    assert_eq!(tokens[&b], alone.token_ids);
    assert_eq!(engine.requests().kv().num_used_blocks(), 0);
}
