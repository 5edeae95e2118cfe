//! Shared helpers: tiny random-weight Ouro models in the real checkpoint layout, prompts, KV
//! checks (the diffusion tests use the prompts that avoid the mask id and the KV check).
#![allow(dead_code)]

use ponder::looped::models::OuroConfig;
use ponder::testing::{tiny_ouro_config, write_random_ouro};
use ponder::{Engine, EngineBuilder, GenerationParams, KvLayoutKind, RequestId};
use std::collections::HashMap;
use std::path::PathBuf;

pub const VOCAB: usize = 97;

/// A tiny Ouro directory (no tokenizer) in a fresh temp dir.
pub fn tiny_dir(seed: u64) -> (tempfile::TempDir, PathBuf) {
    tiny_dir_with(tiny_ouro_config(VOCAB), seed)
}

pub fn tiny_dir_with(cfg: OuroConfig, seed: u64) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny-ouro");
    write_random_ouro(&dir, &cfg, seed).unwrap();
    (tmp, dir)
}

pub fn builder(dir: &PathBuf, layout: KvLayoutKind, width: usize) -> EngineBuilder {
    EngineBuilder::new(dir).looped(|o| o.kv_layout(layout)).max_num_seqs(width).block_size(4).max_num_batched_tokens(512)
}

/// Deterministic prompts of varied lengths (1..=19 tokens).
pub fn prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    (0..n).map(|_| (0..1 + next() % 19).map(|_| next() % VOCAB as u32).collect()).collect()
}

/// Prompts of 1..=21 tokens that never hold the last id of the vocabulary (the tiny diffusion
/// models' mask token).
pub fn diffusion_prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed;
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    (0..n).map(|_| (0..1 + next() % 21).map(|_| next() % (VOCAB as u32 - 1)).collect()).collect()
}

/// Each prompt generated alone, one after another, greedy.
pub fn sequential(engine: &mut Engine, prompts: &[Vec<u32>], max_new: &[usize]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .zip(max_new)
        .map(|(p, &n)| {
            let out = engine.generate([p.clone()], &GenerationParams::greedy(n)).unwrap().remove(0).unwrap();
            out.token_ids
        })
        .collect()
}

/// All prompts queued at once (greedy), driven to completion; tokens per prompt, in order.
pub fn batched(engine: &mut Engine, prompts: &[Vec<u32>], max_new: &[usize]) -> Vec<Vec<u32>> {
    let ids: Vec<RequestId> = prompts.iter().zip(max_new).map(|(p, &n)| engine.add_request(p.clone(), GenerationParams::greedy(n)).unwrap()).collect();
    let mut got = HashMap::new();
    drain(engine, &mut got);
    ids.iter().map(|id| got.remove(id).unwrap_or_default()).collect()
}

/// Drives `engine` until idle, collecting tokens per request.
pub fn drain(engine: &mut Engine, outputs: &mut HashMap<RequestId, Vec<u32>>) {
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let ponder::Event::Token { id, token, .. } = ev {
                outputs.entry(id).or_default().push(token);
            }
        }
    }
}

pub fn assert_kv_empty(engine: &Engine) {
    let kv = engine.requests().kv();
    assert_eq!(kv.num_used_blocks(), 0, "KV blocks leaked");
    assert_eq!(kv.num_resident(), 0, "requests still hold KV tables");
}

/// One named scheduler × layout × gate combination of the conformance matrix.
pub struct Combo {
    pub name: String,
    pub scheduler: ponder::SchedulerKind,
    pub layout: KvLayoutKind,
    pub gate: fn() -> Box<dyn ponder::looped::gate::ExitGate>,
}

/// A named way to make an exit gate.
pub type MakeGate = (&'static str, fn() -> Box<dyn ponder::looped::gate::ExitGate>);

pub fn gates() -> Vec<MakeGate> {
    use ponder::looped::gate::*;
    vec![
        ("fixed4", || Box::new(FixedDepth::new(4).unwrap())),
        ("fixed2", || Box::new(FixedDepth::new(2).unwrap())),
        ("q-exit", || Box::new(QExit::new(0.5, 1, 4).unwrap())),
        ("replay", || Box::new(Replay::new(DepthTrace::with_mean(2.5, 1, 4, 17).unwrap(), 1, 4).unwrap())),
        ("replay-min2", || Box::new(Replay::new(DepthTrace::with_mean(2.8, 2, 4, 17).unwrap(), 2, 4).unwrap())),
        ("lookahead(q-exit)", || Box::new(Lookahead::new(QExit::new(0.5, 1, 4).unwrap()).unwrap())),
        ("learned-lookahead", || Box::new(LearnedLookahead::new(test_head(1, 0.3, 11), 0.5, 1, 4).unwrap())),
        ("preloop", || Box::new(Preloop::new(test_head(4, 0.15, 13), 0.5, 1, 4).unwrap())),
    ]
}

/// A deterministic gate head of `rows` outputs over the tiny model's hidden width, weights
/// spread uniformly over ±`scale`·√3 (standard deviation `scale`).
pub fn test_head(rows: usize, scale: f32, seed: u64) -> ponder::looped::gate::GateHead {
    let hidden = ponder::testing::tiny_ouro_config(VOCAB).hidden_size;
    let mut x = seed;
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale * 3f32.sqrt()
    };
    let weight = (0..rows * hidden).map(|_| next()).collect();
    let bias = (0..rows).map(|_| next()).collect();
    ponder::looped::gate::GateHead { weight, bias, rows, hidden }
}

/// Every valid combination: CB runs full depth only; depth schedulers take every gate whose
/// minimum depth the layout allows.
pub fn combos() -> Vec<Combo> {
    use ponder::SchedulerKind::*;
    let mut out = Vec::new();
    for scheduler in [Continuous, Depth { refill: true }, Depth { refill: false }] {
        for layout in KvLayoutKind::ALL {
            for (gname, gate) in gates() {
                if scheduler == Continuous && gname != "fixed4" {
                    continue;
                }
                let g = gate();
                if ponder::looped::layout::check_layout(layout.build().as_ref(), g.min_steps(), g.max_steps()).is_err() {
                    continue;
                }
                out.push(Combo { name: format!("{scheduler:?} × {layout:?} × {gname}"), scheduler, layout, gate });
            }
        }
    }
    out
}

pub fn combo_builder(dir: &PathBuf, c: &Combo, width: usize) -> EngineBuilder {
    builder(dir, c.layout, width).looped(|o| o.scheduler(c.scheduler).exit_gate_boxed((c.gate)()))
}

/// Admits requests (reserving their KV) and never launches anything.
#[derive(Default)]
pub struct Stuck;
impl ponder::looped::LoopedScheduler for Stuck {
    fn name(&self) -> &'static str {
        "stuck"
    }
    fn schedule(&mut self, requests: &mut ponder::scheduler::Requests) -> Option<ponder::looped::LoopedLaunch> {
        while let Some(r) = requests.front() {
            let need = r.prompt.len() + r.max_new_tokens;
            assert!(requests.admit_front(need).is_some());
        }
        None
    }
    fn complete(&mut self, _: &mut ponder::scheduler::Requests, _: &ponder::looped::LoopedLaunch, _: &ponder::looped::LoopedResult) {}
    fn finished(&mut self, _: ponder::RequestId) {}
}

/// Tiny random checkpoints of all seven families in the released layouts, one directory each
/// under `tmp`: (family, directory).
pub fn family_checkpoints(tmp: &std::path::Path) -> Vec<(&'static str, PathBuf)> {
    use ponder::testing::*;
    let dir = |name: &str| tmp.join(name);
    write_random_ouro(&dir("ouro"), &tiny_ouro_config(VOCAB), 1).unwrap();
    write_random_huginn(&dir("huginn"), &tiny_huginn_config(VOCAB), 2).unwrap();
    write_random_sdar(&dir("sdar"), &tiny_sdar_config(VOCAB), 3).unwrap();
    write_random_sdar(&dir("sdar_moe"), &tiny_sdar_moe_config(VOCAB), 4).unwrap();
    write_random_llada(&dir("llada"), &tiny_llada_config(VOCAB), 5).unwrap();
    write_random_dream(&dir("dream"), &tiny_dream_config(VOCAB), 6).unwrap();
    write_random_llada2(&dir("llada2"), &tiny_llada2_config(VOCAB), 7).unwrap();
    ["ouro", "huginn", "sdar", "sdar_moe", "llada", "dream", "llada2"].into_iter().map(|n| (n, dir(n))).collect()
}

/// `f()`, or the message of the panic it raised.
pub fn caught<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .map_err(|p| p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default())
}

/// Sum of |w| over a checkpoint's `model.safetensors`, in f64: the weight checksum a parity
/// fixture records, so that a test knows it rebuilt the weights the fixture was made from.
pub fn weight_abs_sum(dir: &std::path::Path) -> f64 {
    let t = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    t.values().map(|v| v.to_dtype(candle_core::DType::F64).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()).sum()
}

/// A fixture's unmask policy: `("threshold", τ)` or `("static", n)` as the block-diffusion
/// reference (`tools/reference/block_diffusion_ref.py`) names them.
pub fn fixture_policy(case: &serde_json::Value) -> Box<dyn ponder::diffusion::UnmaskPolicy> {
    let value = case["value"].as_f64().unwrap();
    match case["policy"].as_str().unwrap() {
        "threshold" => Box::new(ponder::diffusion::Threshold::new(value as f32).unwrap()),
        "static" => Box::new(ponder::diffusion::StaticCount::new(value as usize).unwrap()),
        other => panic!("unknown policy {other}"),
    }
}

/// A fixture decode's parameters: greedy for `gen` tokens, or sampled as its `sampling` entry
/// says (`temperature`, optional `top_k` / `top_p`, `seed`).
#[allow(dead_code)]
pub fn fixture_params(case: &serde_json::Value, gen: usize) -> ponder::GenerationParams {
    let greedy = ponder::GenerationParams::greedy(gen);
    let s = &case["sampling"];
    if s.is_null() {
        return greedy;
    }
    let sampling = ponder::SamplingParams {
        temperature: s["temperature"].as_f64().unwrap() as f32,
        top_k: s["top_k"].as_u64().map(|k| k as usize),
        top_p: s["top_p"].as_f64().map(|p| p as f32),
        seed: Some(s["seed"].as_u64().unwrap()),
    };
    ponder::GenerationParams { sampling, ..greedy }
}

/// Drives `engine` until idle; the tokens it streamed and the compute each took
/// (`Event::Token::compute`: loop steps of a looped model), in order.
pub fn tokens_and_steps(engine: &mut Engine) -> (Vec<u32>, Vec<u32>) {
    let (mut tokens, mut steps) = (Vec::new(), Vec::new());
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let ponder::Event::Token { token, compute, .. } = ev {
                tokens.push(token);
                match compute {
                    Some(ponder::TokenCompute::LoopSteps(n)) => steps.push(n),
                    other => panic!("looped tokens report their loop steps, not {other:?}"),
                }
            }
        }
    }
    (tokens, steps)
}

/// Asserts that the `config.json` in `dir` is the one a parity fixture's model was read with:
/// the weight checksum cannot see a changed norm epsilon, RoPE base or block length.
pub fn assert_fixture_config(dir: &std::path::Path, recorded: &serde_json::Value) {
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(&written, recorded, "{}: the fixture was made from another config; make it again", dir.display());
}

/// Scores `tokens` after `prompt` by teacher forcing (EOS not special) and asserts that every
/// log-probability is the reference's `want` within `tol`, relative (with an absolute floor);
/// returns the worst relative error.
pub fn assert_forced_logprobs(engine: &mut Engine, prompt: &[u32], tokens: &[u32], want: &[f64], tol: f64, label: &str) -> f64 {
    let params = GenerationParams { forced_tokens: tokens.to_vec(), ignore_eos: true, ..GenerationParams::greedy(tokens.len()) };
    let out = engine.generate([prompt.to_vec()], &params).unwrap().remove(0).unwrap();
    assert_eq!(out.logprobs.len(), tokens.len(), "{label}: a log-probability per forced token");
    let mut worst = 0f64;
    for (i, (&got, &want)) in out.logprobs.iter().zip(want).enumerate() {
        let err = (got as f64 - want).abs() / (1.0 + want.abs());
        worst = worst.max(err);
        assert!(err <= tol, "{label}: token {i}: log-probability {got} vs the reference's {want}");
    }
    worst
}
