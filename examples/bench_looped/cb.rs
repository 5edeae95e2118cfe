//! Suite `cb`: full-depth continuous batching against the weight-streaming floor.

use crate::{Args, BenchModel, Roof};
use ponder::bench::{random_ids, served_in_full};
use ponder::{EngineBuilder, GenerationParams};

pub(crate) fn cb_suite(args: &Args, model: &BenchModel, roof: Roof, weight_bytes_per_step: u64) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    let spec = model.spec().clone();
    let mut results = Vec::new();
    println!(
        "{:>6} {:>12} {:>12} {:>10} {:>12} {:>10} {:>12} {:>12}",
        "width", "tok/s", "floor tok/s", "of floor", "step ms", "prefill s", "roofline ms", "of roofline"
    );
    for &w in &args.widths {
        let slots = args.layout.build().num_slots(spec.max_steps);
        let per_req = args.prompt_len + args.new_tokens + 16;
        let engine_for = |model: &BenchModel| {
            EngineBuilder::from_model(model.boxed(), None, vec![])
                .looped(|o| o.kv_layout(args.layout))
                .kernels(args.kernels)
                .max_num_seqs(w)
                .max_num_batched_tokens((w * args.prompt_len).clamp(per_req, 16384))
                .kv_capacity_tokens(w * per_req * slots)
                .build()
        };
        let tracked = ponder::bench::device_memory::reset_peak(model.device()).inspect_err(|e| eprintln!("peak memory not measured: {e}")).is_ok();
        let mut engine = match engine_for(model) {
            Ok(e) => e,
            // A width whose pool this card cannot hold is reported, and the others still run.
            Err(e @ ponder::Error::DeviceMemory { .. }) => {
                println!("{w:>6} refused: {e}");
                results.push(serde_json::json!({ "mode": "cb", "layout": format!("{:?}", args.layout), "width": w, "refused": e.to_string() }));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let run = |engine: &mut ponder::Engine, new_tokens: usize, seed: u64| -> Result<(f64, f64, f64, f64), Box<dyn std::error::Error>> {
            let before = engine.metrics().clone();
            let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(new_tokens) };
            let prompts: Vec<Vec<u32>> = (0..w).map(|i| random_ids(args.prompt_len, spec.vocab_size, seed * 1000 + i as u64)).collect();
            served_in_full(engine.generate(prompts, &params)?, new_tokens)?;
            let m = engine.metrics();
            let dec = delta(&before, m, "decode");
            let pre = delta(&before, m, "prefill");
            let cost = m.stages.get("decode").map(|s| s.cost.since(&before.stages.get("decode").cloned().unwrap_or_default().cost)).unwrap_or_default();
            let roofline_step = cost.roofline_seconds(roof.bandwidth, roof.peak) / dec.2.max(1) as f64;
            Ok((dec.1 as f64 / dec.0, dec.0 / dec.2 as f64, pre.0, roofline_step))
        };
        run(&mut engine, 8, 999)?; // warm-up: kernels loaded, allocator primed
        let mut samples = Vec::new();
        for r in 0..args.repeats {
            samples.push(run(&mut engine, args.new_tokens, r as u64)?);
        }
        samples.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (tps, step_s, prefill_s, roofline_s) = samples[samples.len() / 2];
        let floor = w as f64 * roof.bandwidth / weight_bytes_per_step as f64;
        println!(
            "{w:>6} {tps:>12.0} {floor:>12.0} {:>9.1}% {:>12.2} {prefill_s:>10.2} {:>12.2} {:>11.1}%",
            100.0 * tps / floor,
            step_s * 1e3,
            roofline_s * 1e3,
            100.0 * roofline_s / step_s
        );
        let peak = if tracked { ponder::bench::device_memory::peak(model.device()).ok().flatten() } else { None };
        let pool_gb = engine.metrics().kv_pool.bytes as f64 / 1e9;
        if let Some(p) = peak {
            println!("{w:>6} peak device memory {p}; KV pool {pool_gb:.1} GB");
        }
        if args.profile_step {
            profile_one_decode_step(&mut engine, args, w, spec.vocab_size, model.device())?;
        }
        // What the captured decode graphs hold: memory nodes are the allocating ops' outputs.
        let metrics = engine.metrics();
        let nodes = metrics.looped().map(|l| l.graph_nodes).unwrap_or_default();
        let arena_steps = metrics.kernels.arena_steps;
        println!("{w:>6} graph nodes: {} kernels, {} memory, {} copies; {arena_steps} core steps on the arena", nodes.kernels, nodes.memory, nodes.copies);
        results.push(serde_json::json!({
            "mode": "cb", "layout": format!("{:?}", args.layout), "width": w,
            "tokens_per_s": tps, "floor_tokens_per_s": floor, "decode_step_ms": step_s * 1e3,
            "prefill_s": prefill_s, "repeats": samples.iter().map(|s| s.0).collect::<Vec<_>>(),
            "decode_roofline_step_ms": roofline_s * 1e3, "fraction_of_roofline": roofline_s / step_s,
            "kv_pool_gb": pool_gb,
            "graph_kernel_nodes": nodes.kernels, "graph_memory_nodes": nodes.memory, "graph_copy_nodes": nodes.copies,
            "arena_core_steps": arena_steps,
        }));
        if let Some(row) = results.last_mut().and_then(|r| r.as_object_mut()) {
            row.extend(ponder::bench::device_memory::PeakMemory::json_fields(peak).map(|(k, v)| (k.to_string(), v.into())));
        }
        drop(engine);
    }
    Ok(results)
}

/// (seconds, rows, launches) of one stage between two metric snapshots.
fn delta(a: &ponder::EngineMetrics, b: &ponder::EngineMetrics, stage: &str) -> (f64, u64, u64) {
    let get = |m: &ponder::EngineMetrics| m.stages.get(stage).cloned().unwrap_or_default();
    let (x, y) = (get(a), get(b));
    ((y.time - x.time).as_secs_f64(), y.rows - x.rows, y.launches - x.launches)
}

/// Brings W requests to steady decoding and runs one decode launch between `cuProfilerStart` and
/// `cuProfilerStop`, so that `ncu --profile-from-start off` profiles exactly one decode step
/// (`tools/kernel_breakdown.py` groups its kernels by family).
fn profile_one_decode_step(
    engine: &mut ponder::Engine,
    args: &Args,
    w: usize,
    vocab: usize,
    device: &ponder::Device,
) -> Result<(), Box<dyn std::error::Error>> {
    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(16) };
    for i in 0..w {
        engine.add_request(random_ids(args.prompt_len, vocab, 777_000 + i as u64), params.clone())?;
    }
    // Prefill, then a few decode steps so the decode graph is captured and replayed.
    let decodes = |e: &ponder::Engine| e.metrics().stages.get("decode").map_or(0, |s| s.launches);
    let start = decodes(engine);
    while engine.has_work() && decodes(engine) < start + 4 {
        engine.step()?;
    }
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::sys;
        device.synchronize()?;
        // SAFETY: profiler range calls take no arguments and only mark the range.
        unsafe { sys::cuProfilerStart() };
        engine.step()?;
        device.synchronize()?;
        unsafe { sys::cuProfilerStop() };
        println!("profiled one decode step of width {w} (cuProfilerStart/Stop)");
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    while engine.has_work() {
        engine.step()?;
    }
    Ok(())
}
