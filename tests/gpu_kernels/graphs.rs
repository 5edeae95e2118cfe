//! Captured decode graphs against eager decoding: the looped engines' CUDA graphs, the decode
//! arena (no memory node in a graph), cuBLAS products under capture, Huginn's stage graphs, and
//! the device spans that time every launch.

use super::*;

pub(crate) fn graph_test_config() -> ponder::looped::models::OuroConfig {
    let mut cfg = ponder::testing::tiny_ouro_config(512);
    cfg.hidden_size = 256;
    cfg.intermediate_size = 512;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = Some(2);
    cfg.head_dim = Some(64);
    cfg.max_position_embeddings = 2048;
    cfg
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Graphs {
    /// The eager path.
    Off,
    /// The graph path without capture: padded static buffers, bucketed context, run eagerly.
    BodiesOnly,
    /// Captured and replayed.
    On,
}

/// A Huginn small enough for the test and wide enough for the attention kernels (head dim 64).
fn graph_test_huginn() -> ponder::looped::models::HuginnConfig {
    let mut cfg = ponder::testing::tiny_huginn_config(512);
    cfg.n_embd = 256;
    cfg.intermediate_size = 512;
    cfg.n_heads = 4;
    cfg.num_key_value_heads = Some(4);
    cfg.head_dim = Some(64);
    cfg.block_size = 2048;
    cfg.max_steps = 4;
    cfg
}

/// [`graph_test_huginn`] with random bf16 weights (seed 5) on `gpu`, its head tied.
fn graph_test_huginn_model(gpu: &Device) -> ponder::looped::models::Huginn {
    graph_test_huginn_model_of(gpu, graph_test_huginn())
}

/// A Huginn of config `cfg` with random bf16 weights (seed 5) on `gpu`, its head tied.
fn graph_test_huginn_model_of(gpu: &Device, cfg: ponder::looped::models::HuginnConfig) -> ponder::looped::models::Huginn {
    let mut t = ponder::testing::random_tensors(&ponder::testing::huginn_tensor_manifest(&cfg), 5, DType::F32, gpu).unwrap();
    let wte = t["transformer.wte.weight"].clone();
    t.insert("lm_head.weight".into(), wte);
    ponder::looped::models::Huginn::load(&cfg, &ponder::loader::Weights::from_map(t, DType::BF16, gpu)).unwrap()
}

/// Runs `prompts` (all queued at once) to completion, greedy, in one of the [`Graphs`] modes,
/// on the tiny Ouro (or Huginn: prelude and a coda with their own attention blocks).
#[allow(clippy::too_many_arguments)]
fn graph_engine_run(
    gpu: &Device,
    huginn: bool,
    sched: ponder::SchedulerKind,
    layout: ponder::KvLayoutKind,
    width: usize,
    graphs: Graphs,
    prompts: &[Vec<u32>],
    new_tokens: &[usize],
) -> Vec<Vec<u32>> {
    use ponder::looped::models::Ouro;
    let model: Box<dyn ponder::looped::models::LoopedModel> = if huginn {
        Box::new(graph_test_huginn_model(gpu))
    } else {
        let cfg = graph_test_config();
        let weights = ponder::testing::random_ouro_weights(&cfg, 5, DType::BF16, gpu).unwrap();
        Box::new(Ouro::load(&cfg, &weights).unwrap())
    };
    engine_run(model, sched, layout, width, graphs, prompts, new_tokens)
}

/// Runs `prompts` (all queued at once) to completion on `model`, greedy, in one of the
/// [`Graphs`] modes; the depth schedulers exit by a replayed depth trace.
fn engine_run(
    model: Box<dyn ponder::looped::models::LoopedModel>,
    sched: ponder::SchedulerKind,
    layout: ponder::KvLayoutKind,
    width: usize,
    graphs: Graphs,
    prompts: &[Vec<u32>],
    new_tokens: &[usize],
) -> Vec<Vec<u32>> {
    engine_run_with(model, sched, layout, width, graphs, prompts, new_tokens, Default::default()).0
}

/// [`engine_run`] under the kernel policy `kernels`; also returns the engine's metrics.
#[allow(clippy::too_many_arguments)]
fn engine_run_with(
    model: Box<dyn ponder::looped::models::LoopedModel>,
    sched: ponder::SchedulerKind,
    layout: ponder::KvLayoutKind,
    width: usize,
    graphs: Graphs,
    prompts: &[Vec<u32>],
    new_tokens: &[usize],
    kernels: ponder::kernels::KernelPolicy,
) -> (Vec<Vec<u32>>, ponder::EngineMetrics) {
    use ponder::looped::gate::{DepthTrace, Replay};
    let mut b = ponder::EngineBuilder::from_model(model, None, vec![])
        .kernels(kernels)
        .looped(|o| o.scheduler(sched).kv_layout(layout))
        .max_num_seqs(width)
        .max_num_batched_tokens(2048)
        .kv_capacity_tokens(64 * 1024)
        .looped(|o| o.cuda_graphs(graphs != Graphs::Off).graph_capture(graphs != Graphs::BodiesOnly));
    if sched != ponder::SchedulerKind::Continuous {
        let trace = DepthTrace::with_mean(2.5, 1, 4, 9).unwrap();
        b = b.looped(|o| o.exit_gate(Replay::new(trace, 1, 4).unwrap()));
    }
    let mut engine = b.build().unwrap();
    let ids: Vec<_> = prompts
        .iter()
        .zip(new_tokens)
        .map(|(p, &n)| {
            let params = ponder::GenerationParams { ignore_eos: true, ..ponder::GenerationParams::greedy(n) };
            engine.add_request(p.clone(), params).unwrap()
        })
        .collect();
    let mut got: std::collections::HashMap<ponder::RequestId, Vec<u32>> = Default::default();
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let ponder::Event::Token { id, token, .. } = ev {
                got.entry(id).or_default().push(token);
            }
        }
    }
    let tokens = ids.iter().map(|id| got.remove(id).unwrap_or_default()).collect();
    let metrics = engine.metrics().clone();
    keep(engine);
    (tokens, metrics)
}

/// The decode arena (`KernelPolicy::decode_arena`): the same greedy tokens as the plain body —
/// the same kernels and cuBLAS calls, only the output pointers are the arena's. Where the folded
/// decode attention takes the launch (MHA, like Ouro-1.4B: the SIMT fold at head dim 64 with its
/// key splits in the arena's workspace, the ring at 128 under `ring=always`), or for a GQA model
/// its two launches with q in the arena, a graph — CB's full-depth decode, depth batching's core
/// steps and re-entering codas — holds no memory node at all (the plain body's graphs of the GQA
/// case hold 1120 on an H100). The GQA case's 40-row launches cut their keys into more splits
/// than the ring has partials: the workspace is sized for the SIMT plan's most. Huginn's arena
/// body (interleaved RoPE after a q/k bias, then paged attention with q in the arena; the
/// prelude's scaled gather; the `[s | e]` halves by strided copies) leaves none either.
#[test]
fn decode_arena_matches_the_plain_body_with_fewer_memory_nodes() {
    use ponder::looped::models::Ouro;
    use ponder::{KvLayoutKind, SchedulerKind};
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(78);
    let n = 29;
    let prompts = random_prompts(&mut rng, n, 6, 240..300, 1..80);
    let new_tokens: Vec<usize> = (0..n).map(|_| rng.random_range(3..40)).collect();
    // (name, head dim, kv heads of 4 query heads (0: Huginn), policy, scheduler, layout, width,
    // no memory node)
    let cases = [
        ("cb depth-indexed W40", 64, 4, "", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40, true),
        ("cb shared W7", 64, 4, "", SchedulerKind::Continuous, KvLayoutKind::Shared, 7, true),
        ("cdb-refill shared W13", 64, 4, "", SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13, true),
        ("cb d128 ring W40", 128, 4, "ring=always", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40, true),
        ("cb gqa W40", 64, 2, "", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40, true),
        // Huginn: the prelude and the re-entering coda (attention blocks of their own) too.
        ("huginn cb shared W7", 64, 0, "", SchedulerKind::Continuous, KvLayoutKind::Shared, 7, true),
        ("huginn cdb-refill shared W13", 64, 0, "", SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13, true),
        // Huginn-0125's head dim (96) and the layout its benchmark runs, at 16 rows.
        ("huginn cb depth-indexed d96 W16", 96, 0, "", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 16, true),
    ];
    for (name, head_dim, kv_heads, policy, sched, layout, width, none_left) in cases {
        let mut cfg = graph_test_config();
        cfg.head_dim = Some(head_dim);
        cfg.num_key_value_heads = Some(kv_heads.max(1));
        let weights = ponder::testing::random_ouro_weights(&cfg, 5, DType::BF16, &gpu).unwrap();
        let plain_policy: ponder::kernels::KernelPolicy = policy.parse().unwrap();
        let arena_policy = ponder::kernels::KernelPolicy { decode_arena: true, ..plain_policy };
        let model = || -> Box<dyn ponder::looped::models::LoopedModel> {
            match kv_heads {
                0 => {
                    let mut h = graph_test_huginn();
                    (h.head_dim, h.n_embd) = (Some(head_dim), h.n_heads * head_dim);
                    Box::new(graph_test_huginn_model_of(&gpu, h))
                }
                _ => Box::new(Ouro::load(&cfg, &weights).unwrap()),
            }
        };
        let run = |kernels| engine_run_with(model(), sched, layout, width, Graphs::On, &prompts, &new_tokens, kernels);
        let (plain, pm) = run(plain_policy);
        let (arena, am) = run(arena_policy);
        let (pl, al) = (pm.looped().unwrap(), am.looped().unwrap());
        let (pn, an) = (pl.graph_nodes, al.graph_nodes);
        println!(
            "decode arena {name}: {} core steps on it; graphs {} / {}: memory nodes {} -> {}, kernels {} -> {}, copies {} -> {}; rings {} / {}",
            am.kernels.arena_steps,
            pl.graph_captures,
            al.graph_captures,
            pn.memory,
            an.memory,
            pn.kernels,
            an.kernels,
            pn.copies,
            an.copies,
            pm.kernels.decode_ring,
            am.kernels.decode_ring
        );
        assert!(am.kernels.arena_steps > 0 && pm.kernels.arena_steps == 0, "{name}: the arena ran only where asked");
        if head_dim == 128 {
            assert!(am.kernels.decode_ring > 0, "{name}: the ring took decode launches");
        }
        assert_eq!(differing_requests(name, &plain, &arena, &prompts, &new_tokens), 0, "{name}: the arena changed tokens");
        assert!(al.graph_captures > 0 && an.memory < pn.memory, "{name}: memory nodes {} with the arena, {} without", an.memory, pn.memory);
        if none_left {
            assert_eq!(an.memory, 0, "{name}: a graph on the arena allocates nothing");
        }
    }
}

/// cuBLAS's own workspace under capture: products that pick a split-k algorithm at decode rows
/// (Huginn-0125's 17 920-deep MLP projection and 10 560-deep adapter) allocate it with
/// `cudaMallocAsync` unless one is set on the handle; `Graph::capture` sets one, so a graph of
/// them holds kernels only, and replays give the eager products' values.
#[test]
fn cublas_products_captured_hold_no_memory_node() {
    use ponder::engine::internals::{GemmWorkspace, Graph};
    let gpu = gpu_device();
    let workspace = std::sync::Arc::new(GemmWorkspace::new(&gpu).unwrap());
    // (rows, n, k): Huginn's mlp_proj, adapter, proj and qkv, Ouro's down and qkv.
    for (rows, n, k) in [(16, 5280, 17920), (16, 5280, 10560), (64, 5280, 17920), (16, 5280, 5280), (16, 15840, 5280), (16, 2048, 5632), (64, 6144, 2048)] {
        let x = Tensor::randn(0f32, 1.0, (rows, k), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
        let w = Tensor::randn(0f32, 0.02, (n, k), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
        let out = Tensor::zeros((rows, n), DType::BF16, &gpu).unwrap();
        let run = || ponder::ops::into::linear_into(&x, &w, &out);
        Graph::warm_up(&gpu, run).unwrap();
        let eager = out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        out.zeros_like().and_then(|z| out.slice_set(&z, 0, 0)).unwrap();
        let graph = Graph::capture(&gpu, &workspace, run).unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let nodes = graph.nodes().unwrap();
        let replay = out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = eager.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let diff = eager.iter().zip(&replay).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!(
            "linear [{rows}, {k}] x [{n}, {k}]^T captured: {} kernels, {} memory nodes; max |eager - replay| {diff:.3e} (max |eager| {scale:.3e})",
            nodes.kernels, nodes.memory
        );
        assert_eq!(nodes.memory, 0, "[{rows}, {k}] x [{n}, {k}]: cuBLAS allocated under capture");
        assert!(diff <= 1e-2 * scale, "[{rows}, {k}] x [{n}, {k}]: the replay differs from the eager product by {diff}");
    }
}

/// `n` random prompts over a 512-token vocabulary: every `long_every`-th from `long`, the rest
/// from `short` tokens.
fn random_prompts(rng: &mut StdRng, n: usize, long_every: usize, long: std::ops::Range<usize>, short: std::ops::Range<usize>) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = if i % long_every == 0 { rng.random_range(long.clone()) } else { rng.random_range(short.clone()) };
            (0..len).map(|_| rng.random_range(0..512u32)).collect()
        })
        .collect()
}

/// How many requests' greedy tokens differ between two runs (each must have its full length);
/// prints where each one first differs.
fn differing_requests(name: &str, a: &[Vec<u32>], b: &[Vec<u32>], prompts: &[Vec<u32>], new_tokens: &[usize]) -> usize {
    let mut bad = 0;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), new_tokens[i], "{name}: request {i} length (first run)");
        assert_eq!(y.len(), new_tokens[i], "{name}: request {i} length (second run)");
        if x != y {
            bad += 1;
            let first = x.iter().zip(y).position(|(p, q)| p != q);
            println!("{name}: request {i} (prompt {}) differs at {first:?} of {}", prompts[i].len(), x.len());
        }
    }
    bad
}

#[test]
fn cuda_graphs_match_eager() {
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(77);
    // 37 requests: prompts 1..300 tokens (context buckets 256 and 512), 3..60 new tokens, so
    // the decode width walks down through many row buckets, mostly with padding.
    let n = 37;
    let prompts = random_prompts(&mut rng, n, 6, 240..300, 1..80);
    let new_tokens: Vec<usize> = (0..n).map(|_| rng.random_range(3..60)).collect();
    use ponder::{KvLayoutKind, SchedulerKind};
    let cases = [
        ("cb depth-indexed W40", false, SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40),
        ("cb shared W7", false, SchedulerKind::Continuous, KvLayoutKind::Shared, 7),
        ("cdb-refill shared W40", false, SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 40),
        ("cdb-refill shared W13", false, SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13),
        // Huginn's coda (attention blocks writing KV) is captured per (rows, context) too.
        ("huginn cdb-refill shared W13", true, SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13),
        ("huginn cb shared W7", true, SchedulerKind::Continuous, KvLayoutKind::Shared, 7),
    ];
    // Replay must reproduce the graph bodies run eagerly bit for bit. Against the plain eager
    // path, bf16 results may differ slightly: padding changes the gemm row count and the context
    // bucket changes the attention key split, so near-ties can flip a greedy token late in a
    // sequence (first device run: 34/37 identical for CB depth-indexed W40). That comparison is
    // reported and only loosely bounded.
    for (name, huginn, sched, layout, width) in cases {
        let t = std::time::Instant::now();
        let eager = graph_engine_run(&gpu, huginn, sched, layout, width, Graphs::Off, &prompts, &new_tokens);
        let t_eager = t.elapsed();
        let bodies = graph_engine_run(&gpu, huginn, sched, layout, width, Graphs::BodiesOnly, &prompts, &new_tokens);
        let t = std::time::Instant::now();
        let graphs = graph_engine_run(&gpu, huginn, sched, layout, width, Graphs::On, &prompts, &new_tokens);
        let t_graphs = t.elapsed();
        for (i, (a, b)) in bodies.iter().zip(&graphs).enumerate() {
            assert_eq!(a, b, "{name}: request {i}: replay differs from the graph body run eagerly");
        }
        let bad = differing_requests(name, &eager, &graphs, &prompts, &new_tokens);
        println!(
            "cuda graphs {name}: {n} requests, {} tokens; replay == bodies {n}/{n}; identical to eager {}/{n}; eager {:.2}s, graphs {:.2}s",
            new_tokens.iter().sum::<usize>(),
            n - bad,
            t_eager.as_secs_f64(),
            t_graphs.as_secs_f64()
        );
        assert!(bad * 4 <= n, "{name}: {bad}/{n} requests differ from the eager path");
    }
}

/// Diagnostic for the Huginn full-depth graph (its engine-level replay differed from its body
/// run eagerly, so the runner does not capture it): the model's stages captured directly in a
/// graph against the same calls run eagerly on the same static inputs — prelude alone, one core
/// step, coda + head, and the whole full-depth chain. Prints the largest difference of each;
/// requires the chain's logits to agree to bf16 rounding (a real capture bug shows as large,
/// structured differences; a different GEMM algorithm under capture as rounding-level ones).
#[test]
fn huginn_stage_graphs_match_eager_numerically() {
    use ponder::engine::internals::{GemmWorkspace, Graph};
    use ponder::kv::KvStore;
    use ponder::looped::models::Huginn;
    use ponder::looped::models::LoopedModel;
    let gpu = gpu_device();
    let cfg = graph_test_huginn();
    let mut t = ponder::testing::random_tensors(&ponder::testing::huginn_tensor_manifest(&cfg), 5, DType::F32, &gpu).unwrap();
    let wte = t["transformer.wte.weight"].clone();
    t.insert("lm_head.weight".into(), wte);
    let model = Huginn::load(&cfg, &ponder::loader::Weights::from_map(t, DType::BF16, &gpu)).unwrap();
    let s = model.spec().clone();
    let bs = 16;
    let positions: Vec<u32> = vec![17, 40, 3, 100, 250, 0, 63];
    let mut next = 0u32;
    let tables: Vec<Vec<u32>> = positions
        .iter()
        .map(|&p| {
            let n = (p as usize + 1).div_ceil(bs) as u32;
            let tb = (next..next + n).collect();
            next += n;
            tb
        })
        .collect();
    let kv = KvStore::new(s.num_kv_layers, next as usize + 1, bs, s.num_kv_heads, s.head_dim, DType::BF16, &gpu).unwrap();
    let host = PagedBatchHost {
        block_tables: tables,
        context_lens: positions.iter().map(|&p| p + 1).collect(),
        cu_q_lens: (0..=positions.len() as u32).collect(),
        write_positions: vec![],
    };
    let batch = PagedBatch::new(host, bs, AttnMask::Causal, s.num_kv_heads * s.head_dim, &gpu).unwrap();
    let ids = Tensor::new(&[5u32, 77, 300, 12, 9, 400, 1][..], &gpu).unwrap();
    let pos = Tensor::new(positions.as_slice(), &gpu).unwrap();
    type Stage<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;
    let prelude = || -> candle_core::Result<Tensor> { model.prelude(&ids, &model.prepare(&pos)?, &batch, &kv) };
    let h0 = prelude().unwrap();
    let stages: Vec<(&str, Stage)> = vec![
        ("prelude", Box::new(prelude)),
        ("core step", Box::new(|| Ok(model.core_step(&h0, &model.prepare(&pos)?, &batch, &kv)?.hidden))),
        ("coda + head", Box::new(|| model.head(&model.coda(&h0, &model.prepare(&pos)?, &batch, &kv)?))),
        (
            "full depth (prelude, 4 core steps, coda, head)",
            Box::new(|| {
                let input = model.prepare(&pos)?;
                let mut h = model.prelude(&ids, &input, &batch, &kv)?;
                for _ in 0..4 {
                    h = model.core_step(&h, &input, &batch, &kv)?.hidden;
                }
                model.head(&model.coda(&h, &input, &batch, &kv)?)
            }),
        ),
    ];
    let max_abs = |a: &Tensor, b: &Tensor| -> f32 {
        (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
    };
    let workspace = std::sync::Arc::new(GemmWorkspace::new(&gpu).unwrap());
    for (name, run) in &stages {
        // Each stage rewrites the same K/V rows with the same values, so runs are repeatable.
        let eager = Graph::warm_up(&gpu, run).unwrap();
        let again = run().unwrap();
        let out = eager.zeros_like().unwrap();
        let graph = Graph::capture(&gpu, &workspace, || {
            let y = run()?;
            out.slice_set(&y, 0, 0)
        })
        .unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let scale = eager.to_dtype(DType::F32).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap().max(1e-6);
        let (d_again, d_graph) = (max_abs(&eager, &again), max_abs(&eager, &out));
        println!("huginn {name}: max |eager − eager| {d_again:.3e}, max |eager − replay| {d_graph:.3e} (max |eager| {scale:.3e})");
        assert_eq!(d_again, 0.0, "{name}: eager runs are not repeatable");
        assert!(d_graph <= 0.05 * scale, "{name}: replay differs from eager by {d_graph} (scale {scale})");
    }
}

/// `EngineBuilder::time_device`: every launch gets a device-side span, spans are positive and,
/// summed, no longer than the run's wall time (overlap on: spans of consecutive launches do not
/// overlap on one stream).
#[test]
fn device_spans_cover_every_launch() {
    use ponder::looped::gate::{DepthTrace, Replay};
    let gpu = gpu_device();
    let cfg = graph_test_config();
    let weights = ponder::testing::random_ouro_weights(&cfg, 5, DType::BF16, &gpu).unwrap();
    let model = ponder::looped::models::Ouro::load(&cfg, &weights).unwrap();
    let mut engine = ponder::EngineBuilder::from_model(Box::new(model), None, vec![])
        .looped(|o| {
            o.scheduler(ponder::SchedulerKind::Depth { refill: true })
                .exit_gate(Replay::new(DepthTrace::with_mean(2.5, 1, 4, 9).unwrap(), 1, 4).unwrap())
                .kv_layout(ponder::KvLayoutKind::LastExited)
        })
        .max_num_seqs(16)
        .kv_capacity_tokens(64 * 1024)
        .looped(|o| o.time_device(true))
        .build()
        .unwrap();
    engine.set_overlap(true).unwrap();
    let start = std::time::Instant::now();
    for i in 0..24u32 {
        let prompt: Vec<u32> = (0..(5 + i * 7) % 90 + 1).map(|t| (t * 31 + i) % 512).collect();
        engine.add_request(prompt, ponder::GenerationParams { ignore_eos: true, ..ponder::GenerationParams::greedy(12) }).unwrap();
    }
    while engine.has_work() {
        engine.step().unwrap();
    }
    let wall = start.elapsed();
    let m = engine.metrics();
    let mut total = std::time::Duration::ZERO;
    for (stage, s) in &m.stages {
        println!(
            "device spans {stage}: {} launches, {:.2} ms device, {:.2} ms launch wall",
            s.launches,
            s.device_time.as_secs_f64() * 1e3,
            s.time.as_secs_f64() * 1e3
        );
        assert_eq!(s.device_timed, s.launches, "{stage}: every launch has a span");
        assert!(s.device_time > std::time::Duration::ZERO, "{stage}: spans are positive");
        total += s.device_time;
    }
    assert!(total <= wall, "spans {total:?} exceed the wall time {wall:?}");
    keep(engine);
}
