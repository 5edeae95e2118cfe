//! Bad input gets a typed error for that request; other requests go on; no KV block leaks.

mod common;
use common::*;
use ponder::testing::{tiny_ouro_config, write_random_ouro};
use ponder::{EngineBuilder, Error, GenerationParams, InvalidRequest, KvLayoutKind, SamplingParams};
use std::collections::HashMap;

#[test]
fn bad_requests_are_rejected_while_others_finish() {
    let (_tmp, dir) = tiny_dir(7);
    let good = prompts(3, 1);
    let mut solo = builder(&dir, KvLayoutKind::DepthIndexed, 1).build().unwrap();
    let want = sequential(&mut solo, &good, &[8, 8, 8]);

    let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 4).max_model_len(64).kv_capacity_tokens(4 * 96).build().unwrap();
    let mut ids = vec![engine.add_request(good[0].clone(), GenerationParams::greedy(8)).unwrap()];
    let mut got = HashMap::new();
    for ev in engine.step().unwrap() {
        if let ponder::Event::Token { id, token, .. } = ev {
            got.entry(id).or_insert_with(Vec::new).push(token);
        }
    }
    let g = GenerationParams::greedy(8);
    let rejected = |r: ponder::Result<ponder::RequestId>| match r {
        Err(Error::InvalidRequest { reason, .. }) => reason,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert_eq!(rejected(engine.add_request(Vec::<u32>::new(), g.clone())), InvalidRequest::EmptyPrompt);
    assert!(matches!(
        rejected(engine.add_request(vec![1, 2, VOCAB as u32], g.clone())),
        InvalidRequest::UnknownToken { token, .. } if token == VOCAB as u32
    ));
    assert!(matches!(rejected(engine.add_request(vec![1; 60], g.clone())), InvalidRequest::TooLong { max_context: 64, .. }));
    let bad_sampling = GenerationParams { sampling: SamplingParams { top_p: Some(1.5), ..Default::default() }, ..g.clone() };
    assert!(matches!(rejected(engine.add_request(vec![1], bad_sampling)), InvalidRequest::BadSampling(_)));
    let neg_temp = GenerationParams { sampling: SamplingParams { temperature: f32::NAN, ..Default::default() }, ..g.clone() };
    assert!(matches!(rejected(engine.add_request(vec![1], neg_temp)), InvalidRequest::BadSampling(_)));
    // Text prompt with no tokenizer in the model dir.
    assert!(matches!(engine.add_request("hello", g.clone()), Err(Error::Tokenizer(_))));
    assert!(matches!(engine.abort(ponder::RequestId(12345)), Err(Error::UnknownRequest(_))));

    ids.push(engine.add_request(good[1].clone(), g.clone()).unwrap());
    ids.push(engine.add_request(good[2].clone(), g.clone()).unwrap());
    drain(&mut engine, &mut got);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(got[id], want[i], "good request {i} unaffected");
    }
    assert_kv_empty(&engine);
}

#[test]
fn kv_exhausted_is_a_typed_error() {
    let (_tmp, dir) = tiny_dir(8);
    // 8 blocks of 4 tokens in each of 4 depth slots = 32 positions per slot.
    let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 4).kv_capacity_tokens(4 * 32).build().unwrap();
    match engine.add_request(vec![3; 20], GenerationParams::greedy(20)) {
        Err(Error::KvExhausted { needed_blocks: 40, total_blocks: 32, .. }) => {}
        other => panic!("expected KvExhausted, got {other:?}"),
    }
    let out = engine.generate([vec![3u32; 10]], &GenerationParams::greedy(20)).unwrap().remove(0).unwrap();
    assert_eq!(out.token_ids.len(), 20);
    assert_kv_empty(&engine);
}

#[test]
fn abort_mid_generation_frees_blocks_and_reports() {
    let (_tmp, dir) = tiny_dir(9);
    let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 2).build().unwrap();
    let a = engine.add_request(vec![5, 6, 7], GenerationParams::greedy(50)).unwrap();
    let b = engine.add_request(vec![8, 9], GenerationParams::greedy(5)).unwrap();
    engine.step().unwrap();
    engine.step().unwrap();
    assert!(engine.requests().kv().num_used_blocks() > 0);
    engine.abort(a).unwrap();
    let mut finished = HashMap::new();
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let ponder::Event::Finished { id, reason, .. } = ev {
                finished.insert(id, reason);
            }
        }
    }
    assert_eq!(finished[&a], ponder::FinishReason::Aborted);
    assert_eq!(finished[&b], ponder::FinishReason::Length);
    assert!(engine.abort(a).is_err(), "a finished request cannot be aborted twice");
    assert_kv_empty(&engine);
}

#[test]
fn bad_engine_options() {
    let (_tmp, dir) = tiny_dir(10);
    assert!(matches!(EngineBuilder::new(&dir).block_size(0).build(), Err(Error::InvalidOption(_))));
    assert!(matches!(EngineBuilder::new(&dir).max_num_seqs(0).build(), Err(Error::InvalidOption(_))));
    // A width no device holds: refused before the depth scheduler's state bank and free list
    // are sized from it (they aborted the process on a failed allocation).
    let depth = ponder::SchedulerKind::Depth { refill: true };
    assert!(matches!(EngineBuilder::new(&dir).max_num_seqs(1 << 30).looped(|o| o.scheduler(depth)).build(), Err(Error::InvalidOption(_))));
    assert!(matches!(
        EngineBuilder::new(&dir).max_num_seqs(4).looped(|o| o.scheduler(depth).coda_reserve(usize::MAX - 2)).build(),
        Err(Error::InvalidOption(_))
    ));
    assert!(matches!(EngineBuilder::new(&dir).dtype(ponder::DType::U32).build(), Err(Error::InvalidOption(_))));
    assert!("triangular".parse::<KvLayoutKind>().is_err());
    // Kernel choices are the engine's own: another engine keeps the default, and running one
    // leaves the thread's defaults as they were.
    use ponder::ops::{policy, AttentionKernels, KernelPolicy};
    assert!(EngineBuilder::new(dir.join("missing")).attention_kernels(AttentionKernels::Simt).build().is_err());
    let mut simt = EngineBuilder::new(&dir).attention_kernels(AttentionKernels::Simt).build().unwrap();
    let plain = EngineBuilder::new(&dir).build().unwrap();
    assert_eq!(simt.kernels().attention, AttentionKernels::Simt);
    assert_eq!(plain.kernels(), KernelPolicy::default());
    simt.generate(["ab"], &ponder::GenerationParams::greedy(2)).unwrap();
    assert_eq!(policy::current(), KernelPolicy::default());
    let ring: KernelPolicy = "ring=always,fold-simt=off".parse().unwrap();
    assert_eq!(EngineBuilder::new(&dir).kernels(ring).build().unwrap().kernels(), ring);
    // Diffusion options on a looped checkpoint: one typed error, before any weight is read.
    let wrong = EngineBuilder::new(&dir).diffusion(|o| o.delayed_cache(true)).build();
    assert!(matches!(wrong, Err(Error::WrongFamily { options: "diffusion", family: "looped", .. })), "{:?}", wrong.err());
}

#[test]
fn bad_checkpoints_are_typed_errors() {
    let cfg = tiny_ouro_config(VOCAB);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    write_random_ouro(&dir, &cfg, 1).unwrap();
    let build = |d: &std::path::Path| EngineBuilder::new(d).build().map(|_| ());

    // Missing config / weights.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert!(matches!(build(&empty), Err(Error::Io { .. })));
    std::fs::copy(dir.join("config.json"), empty.join("config.json")).unwrap();
    assert!(matches!(build(&empty), Err(Error::Io { .. })));

    // Bad config: unknown family, wrong JSON, invalid values.
    let cfg_text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let with_config = |name: &str, text: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(dir.join("model.safetensors"), d.join("model.safetensors")).unwrap();
        std::fs::write(d.join("config.json"), text).unwrap();
        d
    };
    assert!(matches!(build(&with_config("llama", &cfg_text.replace("\"ouro\"", "\"llama\""))), Err(Error::UnsupportedModel(_))));
    assert!(matches!(build(&with_config("broken", "{ not json")), Err(Error::BadConfig { .. })));
    assert!(matches!(
        build(&with_config("heads", &cfg_text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"))),
        Err(Error::BadConfig { .. })
    ));

    // Mis-shaped: a config with a larger hidden size than the tensors.
    let wider = cfg_text.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    assert!(matches!(build(&with_config("shape", &wider)), Err(Error::BadTensor { .. })));

    // Missing tensor: drop the exit gate.
    let d = with_config("missing", &cfg_text);
    let tensors = candle_core::safetensors::load(d.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut fewer = tensors.clone();
    fewer.remove("model.early_exit_gate.bias");
    candle_core::safetensors::save(&fewer, d.join("model.safetensors")).unwrap();
    match build(&d) {
        Err(Error::BadTensor { name, .. }) => assert_eq!(name, "model.early_exit_gate.bias"),
        other => panic!("expected BadTensor, got {other:?}"),
    }

    // Absurd but well-formed sizes are typed errors before anything is allocated for them
    // (they used to abort the process on a failed allocation of 96 GB / 4 TB).
    let mut json: serde_json::Value = serde_json::from_str(&cfg_text).unwrap();
    json["num_hidden_layers"] = 1_000_000_000u64.into();
    assert!(matches!(build(&with_config("layers", &json.to_string())), Err(Error::BadConfig { reason, .. }) if reason.contains("exceeds")));
    json["num_hidden_layers"] = 4000u64.into();
    assert!(matches!(build(&with_config("layers", &json.to_string())), Err(Error::BadConfig { reason, .. }) if reason.contains("layers configured")));
    let mut json: serde_json::Value = serde_json::from_str(&cfg_text).unwrap();
    json["num_hidden_layers"] = 1u64.into();
    assert!(matches!(build(&with_config("fewer", &json.to_string())), Err(Error::BadConfig { .. })), "a layer of the file would be silently dropped");
    let mut json: serde_json::Value = serde_json::from_str(&cfg_text).unwrap();
    json["total_ut_steps"] = 1_000_000u64.into();
    assert!(matches!(build(&with_config("loops", &json.to_string())), Err(Error::BadConfig { .. })));
    // A KV pool larger than the machine's memory, asked for by hand.
    let huge = EngineBuilder::new(&dir).kv_capacity_tokens(usize::MAX / 4).build();
    assert!(matches!(huge, Err(Error::InvalidOption(ref m)) if m.contains("KV pool")), "{:?}", huge.err());
    let large = EngineBuilder::new(&dir).kv_capacity_tokens(1 << 40).build();
    assert!(matches!(large, Err(Error::DeviceMemory { needed, available, .. }) if needed > available), "{:?}", large.err());
    // A small pool beside launches too large for the machine: refused at build, naming the
    // workspace, rather than failing every request at its first large launch.
    let launches = EngineBuilder::new(&dir).kv_capacity_tokens(1024).max_num_batched_tokens(1 << 36).build();
    assert!(matches!(launches, Err(Error::DeviceMemory { ref what, .. }) if what.contains("launch's workspace")), "{:?}", launches.err());

    // Truncated file.
    let d = with_config("truncated", &cfg_text);
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(build(&d), Err(Error::BadTensor { .. })));
}

#[test]
fn lengths_that_overflow_are_too_long_not_a_panic() {
    let (_tmp, dir) = tiny_dir(11);
    for sched in [ponder::SchedulerKind::Continuous, ponder::SchedulerKind::Depth { refill: true }] {
        let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.scheduler(sched)).build().unwrap();
        match engine.add_request(vec![1, 2, 3], GenerationParams::greedy(usize::MAX)) {
            Err(Error::InvalidRequest { reason: InvalidRequest::TooLong { max_new_tokens: usize::MAX, .. }, .. }) => {}
            other => panic!("{sched:?}: expected TooLong, got {other:?}"),
        }
        assert_kv_empty(&engine);
    }
}

#[test]
fn the_token_budget_limits_launches_not_prompts() {
    let (_tmp, dir) = tiny_dir(12);
    for sched in [ponder::SchedulerKind::Continuous, ponder::SchedulerKind::Depth { refill: true }] {
        let make = |budget| builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.scheduler(sched)).max_num_batched_tokens(budget).build().unwrap();
        let (mut small, mut large) = (make(16), make(8192));
        let prompts = [vec![5u32; 8], (0..100).map(|i| i % 90).collect()];
        let params = GenerationParams::greedy(20);
        let got: Vec<Vec<u32>> = small.generate(prompts.clone(), &params).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect();
        let want: Vec<Vec<u32>> = large.generate(prompts, &params).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect();
        assert_eq!(got, want, "{sched:?}: a 100-token prompt at a budget of 16");
        assert!(got.iter().all(|t| t.len() == 20));
        assert_kv_empty(&small);
    }
}

#[test]
fn options_that_would_be_ignored_are_refused() {
    let (_tmp, dir) = tiny_dir(13);
    let refused = |b: EngineBuilder| matches!(b.build(), Err(Error::InvalidOption(_)));
    let q = || ponder::looped::gate::QExit::new(0.5, 1, 4).unwrap();
    // CB runs full depth: an early-exit gate or a held coda would do nothing.
    assert!(refused(builder(&dir, KvLayoutKind::LastExited, 2).looped(|o| o.exit_gate(q()))));
    assert!(refused(builder(&dir, KvLayoutKind::LastExited, 2).looped(|o| o.min_coda_batch_size(2))));
    // A full-depth gate is what CB does anyway.
    assert!(builder(&dir, KvLayoutKind::LastExited, 2).looped(|o| o.exit_gate(ponder::looped::gate::FixedDepth::new(4).unwrap())).build().is_ok());
    assert!(builder(&dir, KvLayoutKind::LastExited, 2)
        .looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).exit_gate(q()).min_coda_batch_size(2))
        .build()
        .is_ok());
}

/// A gate that never asks to exit, breaking the `max_steps` contract.
#[derive(Debug)]
struct NeverExit;
impl ponder::looped::gate::ExitGate for NeverExit {
    fn name(&self) -> String {
        "never-exit".into()
    }
    fn bounds(&self) -> ponder::looped::gate::StepBounds {
        ponder::looped::gate::StepBounds::new(1, 4).unwrap()
    }
    fn decide(&self, _: ponder::looped::gate::ItemRef, _: usize, _: ponder::looped::gate::StepSignals, _: &mut ponder::looped::gate::GateState) -> bool {
        false
    }
}

/// A gate that declares full depth (4..=4, so the depth-indexed layout is allowed) but asks to
/// exit after every step, breaking the `min_steps` contract.
#[derive(Debug)]
struct ExitsEarly;
impl ponder::looped::gate::ExitGate for ExitsEarly {
    fn name(&self) -> String {
        "exits-early".into()
    }
    fn bounds(&self) -> ponder::looped::gate::StepBounds {
        ponder::looped::gate::StepBounds::new(4, 4).unwrap()
    }
    fn decide(&self, _: ponder::looped::gate::ItemRef, _: usize, _: ponder::looped::gate::StepSignals, _: &mut ponder::looped::gate::GateState) -> bool {
        true
    }
    fn exit_known(&self, _: ponder::looped::gate::ItemRef, _: usize, _: &ponder::looped::gate::GateState) -> Option<bool> {
        Some(true)
    }
}

#[test]
fn a_gate_that_exits_before_its_min_steps_is_overruled() {
    // Depth-indexed: an item leaving early would leave its deeper slots unwritten for later
    // tokens to read (stale K/V, perhaps another request's).
    let (_tmp, dir) = tiny_dir(14);
    let ps = prompts(3, 4);
    let mut full = builder(&dir, KvLayoutKind::DepthIndexed, 3).build().unwrap();
    let want = sequential(&mut full, &ps, &[6, 6, 6]);
    let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 3)
        .looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).exit_gate(ExitsEarly))
        .build()
        .unwrap();
    let got: Vec<Vec<u32>> = engine.generate(ps, &GenerationParams::greedy(6)).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect();
    assert_eq!(got, want, "overruled until step 4, every token runs full depth");
    assert_kv_empty(&engine);
}

#[test]
fn a_gate_that_never_exits_is_stopped_at_its_max_steps() {
    let (_tmp, dir) = tiny_dir(14);
    let ps = prompts(3, 4);
    let mut full = builder(&dir, KvLayoutKind::LastExited, 3).build().unwrap();
    let want = sequential(&mut full, &ps, &[6, 6, 6]);
    let mut engine =
        builder(&dir, KvLayoutKind::LastExited, 3).looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).exit_gate(NeverExit)).build().unwrap();
    let got: Vec<Vec<u32>> = engine.generate(ps, &GenerationParams::greedy(6)).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect();
    assert_eq!(got, want, "overruled at step 4, every token runs full depth");
    assert_kv_empty(&engine);
}

#[test]
fn a_stalled_scheduler_fails_its_requests_and_frees_their_kv() {
    let (_tmp, dir) = tiny_dir(15);
    let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.custom_scheduler(|_| Box::new(Stuck))).build().unwrap();
    let outs = engine.generate([vec![1u32, 2], vec![3u32]], &GenerationParams::greedy(4)).unwrap();
    for out in outs {
        let out = out.unwrap();
        assert!(matches!(out.finish_reason, ponder::FinishReason::Error(ref m) if m.contains("stuck")), "{:?}", out.finish_reason);
        assert!(out.token_ids.is_empty());
    }
    assert!(!engine.has_work());
    assert_kv_empty(&engine);
}

/// Launches each request once as a full-depth prefill, spoiled by `defect` (a custom scheduler
/// with a bug).
struct Spoiled {
    layout: Box<dyn ponder::looped::layout::KvLayout>,
    steps: usize,
    defect: fn(&mut ponder::looped::LoopedLaunch),
}
impl ponder::looped::LoopedScheduler for Spoiled {
    fn name(&self) -> &'static str {
        "spoiled"
    }
    fn schedule(&mut self, requests: &mut ponder::scheduler::Requests) -> Option<ponder::looped::LoopedLaunch> {
        let need = requests.front().map(|r| r.prompt.len() + r.max_new_tokens)?;
        let r = requests.admit_front(need)?;
        let tables = requests.tables(r.id).unwrap().to_vec();
        let row = ponder::looped::LoopedRow::full_depth(r.id, r.prompt, 0, tables);
        let step_slots = (0..self.steps).map(|s| self.layout.slot_for_step(s)).collect();
        let mut launch = ponder::looped::LoopedLaunch { stage: ponder::looped::Stage::Prefill, step_slots, rows: vec![row], kv_copies: vec![], reenter: false };
        (self.defect)(&mut launch);
        Some(launch)
    }
    fn complete(&mut self, _: &mut ponder::scheduler::Requests, _: &ponder::looped::LoopedLaunch, _: &ponder::looped::LoopedResult) {}
    fn finished(&mut self, _: ponder::RequestId) {}
}

#[test]
fn malformed_launches_from_a_custom_scheduler_fail_their_requests() {
    let (_tmp, dir) = tiny_dir(16);
    type Defect = (&'static str, fn(&mut ponder::looped::LoopedLaunch));
    let defects: [Defect; 6] = [
        ("no loop steps", |l| l.step_slots.clear()),
        ("token outside the vocabulary", |l| l.rows[0].tokens[0] = VOCAB as u32),
        ("no block tables", |l| l.rows[0].block_tables.clear()),
        ("table too short", |l| l.rows[0].block_tables[0] = l.rows[0].block_tables[0][..0].into()),
        ("block outside the pool", |l| l.rows[0].block_tables[0] = vec![u32::MAX; 8].into()),
        ("copy outside the cache", |l| l.kv_copies.push(ponder::looped::KvCopy { src: 0, dst: u32::MAX })),
    ];
    for (name, defect) in defects {
        let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 2)
            .looped(|o| o.custom_scheduler(move |ctx| Box::new(Spoiled { layout: ctx.layout, steps: ctx.spec.max_steps, defect })))
            .build()
            .unwrap();
        let outs = engine.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(4)).unwrap();
        let out = outs.into_iter().next().unwrap().unwrap();
        assert!(matches!(out.finish_reason, ponder::FinishReason::Error(ref m) if m.contains("invalid launch")), "{name}: {:?}", out.finish_reason);
        assert_kv_empty(&engine);
    }
}

/// A custom layout with `slots` slots mapping step s to slot `s * stride`.
#[derive(Debug)]
struct Strided {
    slots: usize,
    stride: usize,
}
impl ponder::looped::layout::KvLayout for Strided {
    fn name(&self) -> &'static str {
        "strided"
    }
    fn num_slots(&self, _max_steps: usize) -> usize {
        self.slots
    }
    fn slot_for_step(&self, step: usize) -> usize {
        step * self.stride
    }
}

#[test]
fn custom_layouts_that_address_missing_slots_are_refused() {
    let (_tmp, dir) = tiny_dir(17);
    let build = |slots, stride| EngineBuilder::new(&dir).looped(|o| o.custom_kv_layout(Box::new(Strided { slots, stride }))).build();
    assert!(matches!(build(0, 0), Err(Error::InvalidOption(m)) if m.contains("0 slots")));
    assert!(matches!(build(4, 2), Err(Error::InvalidOption(m)) if m.contains("step 2 maps to slot 4")));
    assert!(build(4, 1).is_ok());
}

#[test]
fn a_recorded_trace_with_an_empty_list_runs_full_depth() {
    let (_tmp, dir) = tiny_dir(18);
    let ps = prompts(2, 6);
    let want = sequential(&mut builder(&dir, KvLayoutKind::LastExited, 2).build().unwrap(), &ps, &[5, 5]);
    // Request 0 has an empty list, request 1 none at all: both run every step.
    let trace = ponder::looped::gate::DepthTrace::Recorded(HashMap::from([(0u64, Vec::new())]));
    let gate = ponder::looped::gate::Replay::new(trace, 1, 4).unwrap();
    let mut engine =
        builder(&dir, KvLayoutKind::LastExited, 2).looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).exit_gate(gate)).build().unwrap();
    let got: Vec<Vec<u32>> = engine.generate(ps, &GenerationParams::greedy(5)).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect();
    assert_eq!(got, want);
    assert_kv_empty(&engine);
}

/// Sets the embedding row of `token` to NaN in a checkpoint's `model.safetensors`: requests
/// whose prompt holds that token see non-finite logits; the others compute exactly as before.
fn poison_embedding(dir: &std::path::Path, token: usize) {
    let file = dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    let e = &t["model.embed_tokens.weight"];
    let (v, h) = e.dims2().unwrap();
    let mut rows: Vec<f32> = e.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    rows[token * h..(token + 1) * h].fill(f32::NAN);
    let poisoned = candle_core::Tensor::from_vec(rows, (v, h), &candle_core::Device::Cpu).unwrap().to_dtype(e.dtype()).unwrap();
    t.insert("model.embed_tokens.weight".into(), poisoned);
    candle_core::safetensors::save(&t, &file).unwrap();
}

/// Both families: the request that meets NaN ends with `FinishReason::Error`, the one beside it
/// in the same launches generates what it generates on the clean checkpoint, no KV leaks.
#[test]
fn non_finite_logits_fail_only_their_request() {
    use ponder::testing::{tiny_sdar_config, write_random_sdar};
    let tmp = tempfile::tempdir().unwrap();
    let ouro = tmp.path().join("ouro");
    ponder::testing::write_random_ouro(&ouro, &ponder::testing::tiny_ouro_config(VOCAB), 31).unwrap();
    let sdar = tmp.path().join("sdar");
    write_random_sdar(&sdar, &tiny_sdar_config(VOCAB), 32).unwrap();
    let (bad, good) = (vec![3u32, 7, 11, 9], vec![4u32, 8, 12, 10, 2]);
    let poisoned_token = 11;
    let make = |dir: &std::path::Path| {
        let b = EngineBuilder::new(dir).max_num_seqs(4).block_size(4).kv_capacity_tokens(4096);
        if dir.ends_with("sdar") {
            b.diffusion(|o| o.block_length(4)).build().unwrap()
        } else {
            b.build().unwrap()
        }
    };
    for dir in [ouro, sdar] {
        let clean = make(&dir).generate([good.clone()], &GenerationParams::greedy(8)).unwrap().remove(0).unwrap().token_ids;
        assert!(!clean.contains(&(poisoned_token as u32)), "pick a prompt whose clean output avoids the poisoned token");
        poison_embedding(&dir, poisoned_token);
        let mut e = make(&dir);
        let outs = e.generate([bad.clone(), good.clone()], &GenerationParams::greedy(8)).unwrap();
        let failed = outs[0].as_ref().unwrap();
        assert!(matches!(&failed.finish_reason, ponder::FinishReason::Error(m) if m.contains("non-finite")), "{dir:?}: {:?}", failed.finish_reason);
        let ok = outs[1].as_ref().unwrap();
        assert_eq!(ok.token_ids, clean, "{dir:?}: the other request goes on unchanged");
        assert_kv_empty(&e);
    }
}
