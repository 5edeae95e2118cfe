//! Huginn: loading tiny checkpoints in the real layout, and the depth-batching conformance
//! matrix on a tiny Huginn (prelude and coda blocks with their own KV, 2h-wide loop state).

mod common;
use common::*;
use ponder::config::ModelConfig;
use ponder::loader::ModelDir;
use ponder::looped::gate::{DepthTrace, ExitGate, FixedDepth, LatentDiff, Lookahead, Replay};
use ponder::testing::{huginn_tensor_manifest, tiny_huginn_config, write_random_huginn};
use ponder::{EngineBuilder, KvLayoutKind, SchedulerKind};

fn tiny_huginn(seed: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny-huginn");
    write_random_huginn(&dir, &tiny_huginn_config(VOCAB), seed).unwrap();
    (tmp, dir)
}

#[test]
fn real_huginn_tensor_names() {
    let m = huginn_tensor_manifest(&ponder::looped::models::HuginnConfig::huginn_0125());
    assert_eq!(m.len(), 8 * 9 + 4, "77 tensors in the released checkpoint, less freqs_cis");
    let block: usize = m.iter().filter(|(n, _)| n.starts_with("transformer.core_block.0.")).map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(block, 395_398_080);
    assert!(m.iter().any(|(n, s)| n == "transformer.adapter.weight" && s == &vec![5280, 10560]));
    assert!(m.iter().any(|(n, s)| n == "transformer.coda.1.attn.qk_bias" && s == &vec![2, 1, 55, 96]));
}

#[test]
fn tiny_huginn_loads_and_generates() {
    let (_tmp, dir) = tiny_huginn(1);
    assert!(matches!(ModelDir::open(&dir).unwrap().config, ModelConfig::Huginn(_)));
    let mut engine = EngineBuilder::new(&dir).block_size(4).build().unwrap();
    let spec = engine.spec().looped().unwrap().clone();
    assert_eq!((spec.num_kv_layers, spec.max_steps, spec.state_width), (4, 6, 128));
    let out = engine.generate([vec![1u32, 2, 3]], &ponder::GenerationParams::greedy(5)).unwrap().remove(0).unwrap();
    assert_eq!(out.token_ids.len(), 5);
    assert!(out.token_ids.iter().all(|&t| (t as usize) < VOCAB), "ids within the real vocabulary");
    // The head has a row per padded-table entry (VOCAB rounded up to 8); its logits stop at VOCAB.
    let cfg = tiny_huginn_config(VOCAB);
    assert!(cfg.table_rows() > VOCAB, "the tiny config pads its table");
    let model = ponder::looped::models::Huginn::load(&cfg, &ModelDir::open(&dir).unwrap().weights(candle_core::DType::F32, &candle_core::Device::Cpu).unwrap())
        .unwrap();
    let h = candle_core::Tensor::zeros((2, cfg.n_embd), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    assert_eq!(ponder::looped::models::LoopedModel::head(&model, &h).unwrap().dims(), &[2, VOCAB]);
    // A missing tensor is a typed error naming it.
    let t = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut fewer = t.clone();
    fewer.remove("transformer.adapter.weight");
    candle_core::safetensors::save(&fewer, dir.join("model.safetensors")).unwrap();
    assert!(matches!(EngineBuilder::new(&dir).build(), Err(ponder::Error::BadTensor { name, .. }) if name == "transformer.adapter.weight"));
}

type MakeGate = (&'static str, fn() -> Box<dyn ExitGate>);

fn gates() -> Vec<MakeGate> {
    vec![
        ("fixed6", || Box::new(FixedDepth::new(6).unwrap())),
        ("latent-diff", || Box::new(LatentDiff::new(0.6, 1, 6).unwrap())),
        ("replay", || Box::new(Replay::new(DepthTrace::with_mean(3.5, 2, 6, 3).unwrap(), 2, 6).unwrap())),
        ("lookahead(latent-diff)", || Box::new(Lookahead::new(LatentDiff::new(0.6, 1, 6).unwrap()).unwrap())),
    ]
}

#[test]
fn huginn_depth_batching_is_batch_invariant() {
    let (_tmp, dir) = tiny_huginn(2);
    let ps = prompts(6, 8);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 3 + (i * 2) % 7).collect();
    let mut runs = 0;
    let mut cb_out = None;
    for scheduler in [SchedulerKind::Continuous, SchedulerKind::Depth { refill: true }, SchedulerKind::Depth { refill: false }] {
        for layout in KvLayoutKind::ALL {
            for (name, gate) in gates() {
                let g = gate();
                if (scheduler == SchedulerKind::Continuous && name != "fixed6")
                    || ponder::looped::layout::check_layout(layout.build().as_ref(), g.min_steps(), g.max_steps()).is_err()
                {
                    continue;
                }
                let make = |w: usize| {
                    let b = builder(&dir, layout, w).looped(|o| o.scheduler(scheduler).exit_gate_boxed(gate()));
                    if scheduler == SchedulerKind::Continuous {
                        b
                    } else {
                        b.looped(|o| o.min_coda_batch_size(2))
                    }
                };
                let want = sequential(&mut make(1).build().unwrap(), &ps, &max_new);
                let mut engine = make(3).build().unwrap();
                assert_eq!(batched(&mut engine, &ps, &max_new), want, "{scheduler:?} × {layout:?} × {name}");
                assert_kv_empty(&engine);
                if scheduler != SchedulerKind::Continuous && name != "fixed6" {
                    let d = engine.metrics().looped().unwrap().mean_depth();
                    assert!(d > 1.0 && d < 6.0, "{scheduler:?} × {layout:?} × {name}: mean depth {d}");
                }
                if name == "fixed6" && layout == KvLayoutKind::Shared {
                    match &cb_out {
                        None => cb_out = Some(want),
                        Some(cb) => assert_eq!(&want, cb, "{scheduler:?} at full depth == CB"),
                    }
                }
                runs += 1;
            }
        }
    }
    assert!(runs >= 20, "{runs} combinations");
}

#[test]
fn released_layout_loads_sharded_fp32_with_freqs_cis() {
    // As released: 4 fp32 shards with an index, lm_head a copy of wte, and a persistent
    // `freqs_cis` buffer that the loader must ignore. Loaded in bf16 and f32 alike.
    let (tmp, dir) = tiny_huginn(3);
    let t = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let sharded = tmp.path().join("released");
    std::fs::create_dir_all(&sharded).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(dir.join(f), sharded.join(f)).unwrap();
    }
    let mut names: Vec<String> = t.keys().cloned().collect();
    names.sort();
    let freqs = candle_core::Tensor::zeros((1, 512, 1, 8, 2), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(names.len().div_ceil(4)).enumerate() {
        let file = format!("model-0000{}-of-00004.safetensors", i + 1);
        let mut part: std::collections::HashMap<String, candle_core::Tensor> = chunk.iter().map(|n| (n.clone(), t[n].clone())).collect();
        if i == 0 {
            part.insert("freqs_cis".into(), freqs.clone());
            weight_map.insert("freqs_cis".into(), file.clone().into());
        }
        candle_core::safetensors::save(&part, sharded.join(&file)).unwrap();
        for n in chunk {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    std::fs::write(sharded.join("model.safetensors.index.json"), serde_json::json!({ "weight_map": weight_map }).to_string()).unwrap();
    let run = |d: &std::path::Path| {
        let mut e = EngineBuilder::new(d).block_size(4).build().unwrap();
        e.generate([vec![5u32, 6, 7, 8]], &ponder::GenerationParams::greedy(6)).unwrap().remove(0).unwrap().token_ids
    };
    assert_eq!(run(&sharded), run(&dir));
    let mut bf16 = EngineBuilder::new(&sharded).dtype(ponder::DType::BF16).block_size(4).build().unwrap();
    assert_eq!(bf16.generate([vec![5u32, 6]], &ponder::GenerationParams::greedy(3)).unwrap().remove(0).unwrap().token_ids.len(), 3);
}

/// Upstream's seeded truncated-normal initial state: batched == sequential under depth batching
/// (the state is a function of seed and position, not of the batch), it changes what the model
/// generates, scale 0 is the zero state, and the option is refused where it does not apply.
#[test]
fn seeded_initial_state_is_batch_invariant() {
    use ponder::looped::models::InitialState;
    let (_tmp, dir) = tiny_huginn(4);
    let ps = prompts(6, 9);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 4 + (i * 3) % 6).collect();
    let make = |w: usize, init: InitialState| {
        builder(&dir, KvLayoutKind::Shared, w).looped(|o| {
            o.scheduler(SchedulerKind::Depth { refill: true })
                .exit_gate(Replay::new(DepthTrace::with_mean(3.5, 2, 6, 11).unwrap(), 2, 6).unwrap())
                .min_coda_batch_size(2)
                .huginn_initial_state(init)
        })
    };
    let noisy = InitialState::TruncatedNormal { scale: 1.0, seed: 7 };
    let want = sequential(&mut make(1, noisy).build().unwrap(), &ps, &max_new);
    let mut engine = make(3, noisy).build().unwrap();
    assert_eq!(batched(&mut engine, &ps, &max_new), want, "batched == sequential with a seeded s0");
    assert_kv_empty(&engine);
    let zeros = sequential(&mut make(1, InitialState::Zeros).build().unwrap(), &ps, &max_new);
    assert_ne!(want, zeros, "a non-zero s0 changes the generation");
    let scale0 = sequential(&mut make(1, InitialState::TruncatedNormal { scale: 0.0, seed: 7 }).build().unwrap(), &ps, &max_new);
    assert_eq!(scale0, zeros, "scale 0 is the zero state");
    let other_seed = sequential(&mut make(1, InitialState::TruncatedNormal { scale: 1.0, seed: 8 }).build().unwrap(), &ps, &max_new);
    assert_ne!(other_seed, want, "the seed matters");

    let bad = make(1, InitialState::TruncatedNormal { scale: -1.0, seed: 7 }).build();
    assert!(matches!(bad, Err(ponder::Error::InvalidOption(_))), "a negative scale is refused");
    let (_t2, ouro) = tiny_dir(1);
    let not_huginn = builder(&ouro, KvLayoutKind::Shared, 1).looped(|o| o.huginn_initial_state(noisy)).build();
    assert!(matches!(not_huginn, Err(ponder::Error::InvalidOption(_))), "Ouro has no initial-state option");
    // A model built in memory takes the state on the model itself, not through the builder.
    let cfg = tiny_huginn_config(VOCAB);
    let mut t = ponder::testing::random_tensors(&huginn_tensor_manifest(&cfg), 4, ponder::DType::F32, &ponder::Device::Cpu).unwrap();
    let wte = t["transformer.wte.weight"].clone();
    t.insert("lm_head.weight".into(), wte);
    let weights = ponder::loader::Weights::from_map(t, ponder::DType::F32, &ponder::Device::Cpu);
    let model = ponder::looped::models::Huginn::load(&cfg, &weights).unwrap();
    let in_memory = EngineBuilder::from_model(Box::new(model.clone()), None, vec![]).looped(|o| o.huginn_initial_state(noisy)).build();
    assert!(matches!(in_memory, Err(ponder::Error::InvalidOption(_))), "the builder option is for model directories");
    let seeded = model.with_initial_state(noisy).unwrap();
    assert_eq!(seeded.initial_state(), noisy);
    assert!(EngineBuilder::from_model(Box::new(seeded), None, vec![]).build().is_ok());
}

/// A coda reserve lets more requests be resident than a launch holds: output is unchanged
/// (batched == sequential, with and without overlap) and the option is refused where it does
/// not apply.
#[test]
fn coda_reserve_is_batch_invariant() {
    let (_tmp, dir) = tiny_huginn(5);
    let ps = prompts(7, 8);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 3 + (i * 5) % 8).collect();
    let make = |w: usize, reserve: usize| {
        builder(&dir, KvLayoutKind::Shared, w).looped(|o| {
            o.scheduler(SchedulerKind::Depth { refill: true })
                .exit_gate(Replay::new(DepthTrace::with_mean(3.5, 2, 6, 13).unwrap(), 2, 6).unwrap())
                .min_coda_batch_size(3)
                .coda_reserve(reserve)
        })
    };
    let want = sequential(&mut make(1, 0).build().unwrap(), &ps, &max_new);
    for overlap in [false, true] {
        let mut engine = make(3, 2).build().unwrap();
        engine.set_overlap(overlap).unwrap();
        assert_eq!(batched(&mut engine, &ps, &max_new), want, "width 3 + reserve 2, overlap {overlap}");
        assert_kv_empty(&engine);
    }
    let huge = make(2, usize::MAX).build();
    assert!(matches!(huge, Err(ponder::Error::InvalidOption(_))), "a reserve past u32 resident ids is refused");
    for kind in [SchedulerKind::Continuous, SchedulerKind::Depth { refill: false }] {
        let bad = builder(&dir, KvLayoutKind::Shared, 2).looped(|o| o.scheduler(kind).coda_reserve(1)).build();
        assert!(matches!(bad, Err(ponder::Error::InvalidOption(_))), "{kind:?} refuses a coda reserve");
    }
}

/// Huginn has no trained gate head (its latent-difference gate keeps its one-step-late path): a
/// learned lookahead head and a preloop gate are refused with a typed error, before anything runs.
#[test]
fn trained_gate_heads_are_refused_for_huginn() {
    let (tmp, dir) = tiny_huginn(33);
    let h = tiny_huginn_config(VOCAB).n_embd;
    let w = candle_core::Tensor::zeros((1, h), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let b = candle_core::Tensor::zeros(1, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let path = tmp.path().join("head.safetensors");
    candle_core::safetensors::save(&std::collections::HashMap::from([("weight".to_string(), w), ("bias".to_string(), b)]), &path).unwrap();
    let gate = ponder::looped::gate::LearnedLookahead::load(&path, 0.5, 1, 4).unwrap();
    let err = ponder::EngineBuilder::new(&dir)
        .looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).kv_layout(ponder::KvLayoutKind::LastExited).exit_gate(gate))
        .build();
    assert!(matches!(&err, Err(ponder::Error::InvalidOption(m)) if m.contains("no exit-gate head")), "{:?}", err.err());
    // Nor has it a preloop gate: its prelude has attention layers, so a depth is no function of
    // the token alone.
    let head = ponder::looped::gate::GateHead { weight: vec![0.0; 4 * h], bias: vec![0.0; 4], rows: 4, hidden: h };
    let gate = ponder::looped::gate::Preloop::new(head, 0.5, 1, 4).unwrap();
    let err = ponder::EngineBuilder::new(&dir)
        .looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).kv_layout(ponder::KvLayoutKind::LastExited).exit_gate(gate))
        .build();
    assert!(matches!(&err, Err(ponder::Error::InvalidOption(m)) if m.contains("preloop")), "{:?}", err.err());
}
