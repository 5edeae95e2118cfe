//! Engine options and request parameters at their extremes, for every family: sizes from 0 to
//! `usize::MAX`, floats negative, tiny, huge, NaN and infinite, prompts empty, out of the
//! vocabulary or beyond the context, forced tokens and stop strings of every kind. An engine
//! either refuses the option when it is built, or serves every request — to its end or to a
//! typed error for that request — and holds no KV block afterwards. Nothing panics.

mod common;
use common::{assert_kv_empty, caught, family_checkpoints, VOCAB};
use ponder::diffusion::Confidence;
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind, SamplingParams, SchedulerKind};
use std::path::Path;

const SIZES: [usize; 10] = [0, 1, 2, 3, 5, 7, 17, 4096, 1 << 40, usize::MAX];
const FLOATS: [f64; 9] = [0.0, -1.0, 1e-30, 0.5, 1.0, 1.5, 1e30, f64::NAN, f64::INFINITY];

/// One case: an engine configured by `builder`, serving `prompts` under `params`.
struct Case {
    label: String,
    builder: Box<dyn Fn() -> EngineBuilder>,
    params: GenerationParams,
    prompts: Vec<Vec<u32>>,
}

/// What is wrong with the case's outcome, if anything: a panic, a failed `generate` call (only
/// requests may fail), a KV block still held.
fn check(case: &Case) -> Option<String> {
    let outcome = caught(|| -> Option<String> {
        let Ok(mut engine) = (case.builder)().build() else { return None };
        if let Err(e) = engine.generate(case.prompts.clone(), &case.params) {
            return Some(format!("generate failed as a whole: {e}"));
        }
        let kv = engine.requests().kv();
        (kv.num_used_blocks() != 0 || kv.num_resident() != 0).then(|| format!("KV held afterwards: {} blocks", kv.num_used_blocks()))
    });
    match outcome {
        Ok(problem) => problem,
        Err(msg) => Some(format!("panicked: {msg}")),
    }
}

fn sampled(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> GenerationParams {
    GenerationParams { sampling: SamplingParams { temperature, top_k, top_p, seed: Some(1) }, ..GenerationParams::greedy(5) }
}

fn cases(family: &str, dir: &Path) -> Vec<Case> {
    let looped = matches!(family, "ouro" | "huginn");
    let prompts = vec![vec![1u32, 2, 3, 4, 5], vec![7u32; 13], vec![9u32]];
    let mut cases = Vec::new();
    let mut add = |label: String, builder: Box<dyn Fn() -> EngineBuilder>, params: GenerationParams, prompts: &[Vec<u32>]| {
        cases.push(Case { label: format!("{family}: {label}"), builder, params, prompts: prompts.to_vec() })
    };
    let base = {
        let dir = dir.to_path_buf();
        move || EngineBuilder::new(&dir).block_size(4).max_num_seqs(3).max_num_batched_tokens(256).kv_capacity_tokens(1024)
    };
    let greedy = GenerationParams::greedy(5);
    for n in SIZES {
        let b = base.clone();
        add(format!("max_num_seqs {n}"), Box::new(move || b().max_num_seqs(n)), greedy.clone(), &prompts);
        let b = base.clone();
        add(format!("max_num_batched_tokens {n}"), Box::new(move || b().max_num_batched_tokens(n)), greedy.clone(), &prompts);
        let b = base.clone();
        add(format!("block_size {n}"), Box::new(move || b().block_size(n)), greedy.clone(), &prompts);
        let b = base.clone();
        add(format!("kv_capacity_tokens {n}"), Box::new(move || b().kv_capacity_tokens(n)), greedy.clone(), &prompts);
        let b = base.clone();
        add(format!("max_model_len {n}"), Box::new(move || b().max_model_len(n)), greedy.clone(), &prompts);
        add(format!("max_new_tokens {n}"), Box::new(base.clone()), GenerationParams::greedy(n), &prompts);
        add(format!("top_k {n}"), Box::new(base.clone()), sampled(1.0, Some(n), None), &prompts);
        if looped {
            let depth = move |o: ponder::LoopedOptions| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(KvLayoutKind::Shared);
            let b = base.clone();
            add(format!("min_coda_batch_size {n}"), Box::new(move || b().looped(|o| depth(o).min_coda_batch_size(n))), greedy.clone(), &prompts);
            let b = base.clone();
            add(format!("coda_reserve {n}"), Box::new(move || b().looped(|o| depth(o).coda_reserve(n))), greedy.clone(), &prompts);
        } else {
            let b = base.clone();
            add(format!("block_length {n}"), Box::new(move || b().diffusion(|o| o.block_length(n))), greedy.clone(), &prompts);
            let b = base.clone();
            add(format!("max_steps_per_block {n}"), Box::new(move || b().diffusion(|o| o.max_steps_per_block(n))), greedy.clone(), &prompts);
            if family == "dream" {
                let b = base.clone();
                add(format!("dream_sampler {n}"), Box::new(move || b().diffusion(|o| o.dream_sampler(n, Confidence::Margin))), greedy.clone(), &prompts);
            }
        }
    }
    for f in FLOATS {
        let d = dir.to_path_buf();
        add(format!("kv_memory_fraction {f}"), Box::new(move || EngineBuilder::new(&d).kv_memory_fraction(f)), greedy.clone(), &prompts);
        add(format!("temperature {f}"), Box::new(base.clone()), sampled(f as f32, None, None), &prompts);
        add(format!("top_p {f}"), Box::new(base.clone()), sampled(1.0, None, Some(f as f32)), &prompts);
    }
    for forced in [vec![0u32], vec![VOCAB as u32], vec![u32::MAX], vec![3u32; 50]] {
        add(format!("forced_tokens {:?}…", &forced[..1]), Box::new(base.clone()), GenerationParams { forced_tokens: forced, ..greedy.clone() }, &prompts);
    }
    for stop in ["", "\0", &"a".repeat(10_000)] {
        add(format!("stop {:?}…", stop.get(..2)), Box::new(base.clone()), GenerationParams { stop: vec![stop.to_string()], ..greedy.clone() }, &prompts);
    }
    for prompt in [vec![], vec![VOCAB as u32], vec![u32::MAX], vec![1u32; 5000], vec![VOCAB as u32 - 1; 7]] {
        add(format!("prompt of {} tokens from {:?}", prompt.len(), prompt.first()), Box::new(base.clone()), greedy.clone(), &[prompt, vec![4u32, 5]]);
    }
    cases
}

#[test]
fn extreme_options_and_parameters_are_refused_or_served_without_leaks() {
    let tmp = tempfile::tempdir().unwrap();
    let mut problems = Vec::new();
    for (family, dir) in family_checkpoints(tmp.path()) {
        let base = EngineBuilder::new(&dir).block_size(4).max_num_seqs(3).max_num_batched_tokens(256).kv_capacity_tokens(1024).build();
        assert!(base.is_ok(), "{family}: the options every case starts from build: {:?}", base.err());
        let mut plain = EngineBuilder::new(&dir).block_size(4).max_num_seqs(3).kv_capacity_tokens(1024).build().unwrap();
        plain.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(3)).unwrap().remove(0).unwrap();
        assert_kv_empty(&plain);
        for case in cases(family, &dir) {
            problems.extend(check(&case).map(|p| format!("{}: {p}", case.label)));
        }
    }
    assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n"));
}
