//! Trained gate heads: a learned lookahead head in the CDB authors' file format loads, is
//! installed into the model, and — initialised from the stock gate — reproduces today's delayed
//! stock gate token for token; another head changes the depths; batched output equals each request
//! alone; a head of the wrong width or on a model without a gate head is a typed error. A preloop
//! head runs each token to the depth its embedding picks, with and without overlap.

mod common;
use common::*;
use ponder::looped::gate::{GateHead, LearnedLookahead, Lookahead, Preloop, QExit};
use ponder::{KvLayoutKind, SchedulerKind};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Writes the checkpoint's stock exit gate, with `bias_shift` added to its bias, as a head file.
fn head_from_stock(dir: &Path, out: &Path, bias_shift: f32) -> PathBuf {
    let t = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let w = t["model.early_exit_gate.weight"].to_dtype(candle_core::DType::F32).unwrap();
    let b = (t["model.early_exit_gate.bias"].to_dtype(candle_core::DType::F32).unwrap() + bias_shift as f64).unwrap();
    let path = out.join(format!("lookahead_exit_gate_{bias_shift}.safetensors"));
    let map: HashMap<String, candle_core::Tensor> = [("weight".to_string(), w), ("bias".to_string(), b)].into();
    candle_core::safetensors::save(&map, &path).unwrap();
    path
}

#[test]
fn a_stock_initialised_head_is_the_delayed_stock_gate_and_batches_exactly() {
    let (tmp, dir) = tiny_dir(71);
    let stock = head_from_stock(&dir, tmp.path(), 0.0);
    let shifted = head_from_stock(&dir, tmp.path(), 3.0);
    let ps = prompts(7, 19);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 5 + (i * 3) % 7).collect();
    for refill in [true, false] {
        let sched = SchedulerKind::Depth { refill };
        let make = |width: usize, gate: Box<dyn ponder::looped::gate::ExitGate>| {
            builder(&dir, KvLayoutKind::LastExited, width).looped(|o| o.scheduler(sched).exit_gate_boxed(gate)).build().unwrap()
        };
        let delayed = || Box::new(Lookahead::new(QExit::new(0.5, 1, 4).unwrap()).unwrap());
        let learned = |p: &Path| Box::new(LearnedLookahead::load(p, 0.5, 1, 4).unwrap());
        let mut reference = make(3, delayed());
        let want = batched(&mut reference, &ps, &max_new);
        let mut mine = make(3, learned(&stock));
        assert_eq!(batched(&mut mine, &ps, &max_new), want, "refill={refill}: stock-initialised head == delayed stock gate");
        assert_eq!(mine.metrics().looped().unwrap().depth_histogram, reference.metrics().looped().unwrap().depth_histogram);
        let mut ahead = make(3, learned(&stock));
        ahead.set_overlap(true).unwrap();
        assert_eq!(batched(&mut ahead, &ps, &max_new), want, "refill={refill}: with overlap");
        // Batched == each request alone under another head, whose higher hazards exit earlier.
        let mut solo = make(1, learned(&shifted));
        let alone = sequential(&mut solo, &ps, &max_new);
        let mut wide = make(3, learned(&shifted));
        assert_eq!(batched(&mut wide, &ps, &max_new), alone, "refill={refill}: shifted head batched == alone");
        assert_kv_empty(&wide);
        let (d_stock, d_shifted) = (mine.metrics().looped().unwrap().mean_depth(), wide.metrics().looped().unwrap().mean_depth());
        assert!(d_shifted < d_stock, "refill={refill}: a head with higher hazards exits earlier ({d_shifted} vs {d_stock})");
    }
}

#[test]
fn heads_that_do_not_fit_the_model_are_refused() {
    let (tmp, dir) = tiny_dir(72);
    let w = candle_core::Tensor::zeros((1, 7), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let b = candle_core::Tensor::zeros(1, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let path = tmp.path().join("narrow.safetensors");
    candle_core::safetensors::save(&HashMap::from([("weight".to_string(), w), ("bias".to_string(), b)]), &path).unwrap();
    let gate = LearnedLookahead::load(&path, 0.5, 1, 4).unwrap();
    let err = builder(&dir, KvLayoutKind::LastExited, 2).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(gate)).build();
    assert!(matches!(err, Err(ponder::Error::BadTensor { .. })), "{:?}", err.err());
    let stock = head_from_stock(&dir, tmp.path(), 0.0);
    let gate = LearnedLookahead::load(&stock, 0.5, 1, 4).unwrap();
    // A trained gate already decides ahead: wrapping it would leave its head uninstalled.
    assert!(Lookahead::new(LearnedLookahead::load(&stock, 0.5, 1, 4).unwrap()).is_err());
    // CB runs full depth: an early-exit gate would be ignored.
    assert!(builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.exit_gate(gate)).build().is_err());
}

/// The depth the preloop rule picks for each token, computed here from the checkpoint's
/// embedding in f64: softmax over the head's logits, first depth whose CDF reaches q, clamped.
fn preloop_depths(dir: &Path, head: &GateHead, q: f64, min: usize) -> Vec<usize> {
    let t = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let embed: Vec<Vec<f32>> = t["model.embed_tokens.weight"].to_dtype(candle_core::DType::F32).unwrap().to_vec2().unwrap();
    embed
        .iter()
        .map(|e| {
            let z: Vec<f64> = (0..head.rows)
                .map(|r| head.bias[r] as f64 + (0..head.hidden).map(|i| head.weight[r * head.hidden + i] as f64 * e[i] as f64).sum::<f64>())
                .collect();
            let m = z.iter().cloned().fold(f64::MIN, f64::max);
            let total: f64 = z.iter().map(|v| (v - m).exp()).sum();
            let mut cdf = 0.0;
            let d = z.iter().position(|v| {
                cdf += (v - m).exp() / total;
                cdf >= q
            });
            d.map_or(head.rows, |i| i + 1).max(min)
        })
        .collect()
}

#[test]
fn a_preloop_head_runs_each_token_to_the_depth_its_embedding_picks() {
    let (tmp, dir) = tiny_dir(73);
    let head = test_head(4, 0.15, 5);
    // The head in the authors' file format, loaded back.
    let path = tmp.path().join("preloop_exit_gate.safetensors");
    let w = candle_core::Tensor::from_vec(head.weight.clone(), (4, head.hidden), &candle_core::Device::Cpu).unwrap();
    let b = candle_core::Tensor::from_vec(head.bias.clone(), 4, &candle_core::Device::Cpu).unwrap();
    candle_core::safetensors::save(&HashMap::from([("weight".to_string(), w), ("bias".to_string(), b)]), &path).unwrap();
    let ps = prompts(6, 23);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 6 + i % 4).collect();
    for (min, overlap) in [(1, false), (1, true), (2, true)] {
        let want = preloop_depths(&dir, &head, 0.5, min);
        assert!(want.contains(&min) && want.iter().any(|&d| d > 2), "the head spreads depths: {want:?}");
        let gate = Preloop::load(&path, 0.5, min, 4).unwrap();
        let mut engine =
            builder(&dir, KvLayoutKind::LastExited, 3).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(gate)).build().unwrap();
        engine.set_overlap(overlap).unwrap();
        let ids: Vec<_> = ps.iter().zip(&max_new).map(|(p, &n)| engine.add_request(p.clone(), ponder::GenerationParams::greedy(n)).unwrap()).collect();
        let mut tokens: HashMap<ponder::RequestId, Vec<(u32, Option<u32>)>> = HashMap::new();
        while engine.has_work() {
            for ev in engine.step().unwrap() {
                if let ponder::Event::Token { id, token, compute, .. } = ev {
                    let steps = compute.map(|c| match c {
                        ponder::TokenCompute::LoopSteps(n) => n,
                        other => panic!("a looped model reported {other:?}"),
                    });
                    tokens.entry(id).or_default().push((token, steps));
                }
            }
        }
        let (mut checked, mut depth_one) = (0, 0);
        for (i, id) in ids.iter().enumerate() {
            let got = &tokens[id];
            assert_eq!(got.len(), max_new[i]);
            // The first token comes from the full-depth prefill; each later one ran the depth of
            // the token before it.
            for k in 1..got.len() {
                let d = want[got[k - 1].0 as usize];
                assert_eq!(got[k].1, Some(d as u32), "min {min}, overlap {overlap}: request {i} token {k}");
                checked += 1;
                depth_one += usize::from(d == 1);
            }
        }
        assert!(checked > 20);
        assert!(min > 1 || depth_one > 0, "overlap {overlap}: some generated token ran a single step");
        assert_kv_empty(&engine);
    }
    // Asked for more steps than the head was trained for: a typed error.
    let three = GateHead { weight: head.weight[..3 * head.hidden].to_vec(), bias: head.bias[..3].to_vec(), rows: 3, hidden: head.hidden };
    assert!(matches!(Preloop::new(three, 0.5, 1, 4), Err(ponder::Error::InvalidOption(_))));
    // A head of another width than the model's hidden size.
    let narrow = GateHead { weight: vec![0.0; 4 * 7], bias: vec![0.0; 4], rows: 4, hidden: 7 };
    let err = builder(&dir, KvLayoutKind::LastExited, 2)
        .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(Preloop::new(narrow, 0.5, 1, 4).unwrap()))
        .build();
    assert!(matches!(err, Err(ponder::Error::BadTensor { .. })), "{:?}", err.err());
}
