//! Trained gate heads (issue 20, the engine part): a learned lookahead head in the CDB authors'
//! file format loads, is installed into the model, and — initialised from the stock gate —
//! reproduces today's delayed stock gate token for token; another head changes the depths; batched
//! output equals each request alone; a head of the wrong width or on a model without a gate head
//! is a typed error.

mod common;
use common::*;
use ponder::gate::{LearnedLookahead, Lookahead, QExit};
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
        let make = |width: usize, gate: Box<dyn ponder::gate::ExitGate>| {
            builder(&dir, KvLayoutKind::LastExited, width).looped(|o| o.scheduler(sched).exit_gate_boxed(gate)).build().unwrap()
        };
        let delayed = || Box::new(Lookahead::new(QExit::new(0.5, 1, 4).unwrap()).unwrap());
        let learned = |p: &Path| Box::new(LearnedLookahead::load(p, 0.5, 1, 4).unwrap());
        let mut reference = make(3, delayed());
        let want = batched(&mut reference, &ps, &max_new);
        let mut mine = make(3, learned(&stock));
        assert_eq!(batched(&mut mine, &ps, &max_new), want, "refill={refill}: stock-initialised head == delayed stock gate");
        assert_eq!(mine.metrics().depth_histogram, reference.metrics().depth_histogram);
        let mut ahead = make(3, learned(&stock));
        ahead.set_overlap(true).unwrap();
        assert_eq!(batched(&mut ahead, &ps, &max_new), want, "refill={refill}: with overlap");
        // Batched == each request alone under another head, whose higher hazards exit earlier.
        let mut solo = make(1, learned(&shifted));
        let alone = sequential(&mut solo, &ps, &max_new);
        let mut wide = make(3, learned(&shifted));
        assert_eq!(batched(&mut wide, &ps, &max_new), alone, "refill={refill}: shifted head batched == alone");
        assert_kv_empty(&wide);
        let (d_stock, d_shifted) = (mine.metrics().mean_depth(), wide.metrics().mean_depth());
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
    // CB runs full depth: an early-exit gate would be ignored.
    assert!(builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.exit_gate(gate)).build().is_err());
}
