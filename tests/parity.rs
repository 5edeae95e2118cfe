//! Parity with an independent PyTorch implementation (tools/reference/ouro_ref.py, float64):
//! the shipped tiny Ouro's next-token logits and per-step exit-gate logits for fixed prompts,
//! computed by Ponder in f32 on the CPU as one batched prefill, match within 1e-5 relative.

use ponder::engine::LoopedRunner;
use ponder::kv::{KvLayoutKind, KvManager};
use ponder::loader::ModelDir;
use ponder::models::looped::Ouro;
use ponder::models::ModelConfig;
use ponder::scheduler::{Launch, LaunchRow, Stage};
use ponder::{DType, Device, RequestId};

#[derive(serde::Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    logits_last: Vec<f64>,
    gate_logits_last: Vec<f64>,
}

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum::<f64>().sqrt();
    num / b.iter().map(|y| y * y).sum::<f64>().sqrt()
}

#[test]
fn tiny_ouro_matches_the_pytorch_reference() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/tiny_ouro_reference.json")).unwrap()).unwrap();
    let dir = ModelDir::open(root.join("assets/tiny-ouro")).unwrap();
    let ModelConfig::Ouro(cfg) = &dir.config else { panic!("tiny-ouro is an Ouro model") };
    // The prompts tokenise as the fixture says (same tokenizer.json in both worlds).
    let tok = dir.tokenizer().unwrap().unwrap();
    for c in &fx.cases {
        assert_eq!(tok.encode(c.text.as_str(), false).unwrap().get_ids(), c.ids.as_slice(), "{}", c.text);
    }
    let model = Ouro::load(cfg, &dir.weights(DType::F32, &Device::Cpu).unwrap()).unwrap();
    let steps = cfg.total_ut_steps;
    let mut kv = KvManager::new(64, 16, KvLayoutKind::DepthIndexed.build(), steps);
    let rows = fx
        .cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let id = RequestId(i as u64);
            assert!(kv.reserve(id, c.ids.len()));
            LaunchRow::full_depth(id, c.ids.clone(), 0, kv.tables(id).unwrap().to_vec())
        })
        .collect();
    let launch = Launch { stage: Stage::Prefill, step_slots: (0..steps).collect(), rows, kv_copies: vec![], reenter: false };
    let runner = LoopedRunner::new(Box::new(model), 64, 16, 0).unwrap();
    let fwd = runner.forward(&launch).unwrap();
    let logits = fwd.logits.unwrap().to_vec2::<f32>().unwrap();
    let gates = fwd.gate_logits.unwrap().t().unwrap().to_vec2::<f32>().unwrap();
    for (i, c) in fx.cases.iter().enumerate() {
        let e = rel_err(&logits[i], &c.logits_last);
        let g = rel_err(&gates[i], &c.gate_logits_last);
        println!("{}: logits rel err {e:.2e}, gate logits rel err {g:.2e}", c.text);
        assert!(e <= 1e-5, "{}: logits rel err {e:.2e}", c.text);
        assert!(g <= 1e-5, "{}: gate logits rel err {g:.2e}", c.text);
    }
}
