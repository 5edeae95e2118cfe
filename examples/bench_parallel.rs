//! Tensor and expert parallelism against one device: throughput of the same workload on 1 and
//! on N ranks, alternated (1, N, 1, N, …) in one process, and the all-reduce the ranks run per
//! step against the collective's own bus bandwidth on this machine.
//!
//! Models are released shapes with random weights, each rank making only its shard
//! (`testing::lazy_random_weights`), so models larger than one GPU run too:
//!
//! ```text
//! bench_parallel --cuda --shapes ouro-1.4b --tp 1,2 --width 64 --modes cb,cdb-refill
//! bench_parallel --cuda --shapes sdar-8b --tp 1,2 --width 256
//! bench_parallel --cuda --shapes llada2-flash --tp 4 --expert-parallel --modes baseline,focus
//! bench_parallel --shapes tiny-ouro --tp 1,2          # the CPU: ranks as threads
//! ```
//!
//! Looped models: `--modes cb` (continuous batching at full depth; decode tokens/s over the
//! decode launches) and `cdb-refill` (depth batching with refill and overlap, exit depths
//! replayed at mean 2.5 of 4; generated tokens/s over the run). Diffusion models: `baseline`,
//! `baseline-delayed`, `focus`, generated tokens/s over the run, unmask counts replayed at a
//! realised mean (`--mean-unmask`, as in `bench_serving`). Every rank runs the same launches. `--json FILE` writes
//! every measurement with the machine, `--commit SHA` and the command.

use ponder::config::ModelConfig;
use ponder::diffusion::models::{Llada2Config, SdarConfig};
use ponder::looped::models::OuroConfig;
use ponder::{DType, Device, EngineBuilder, GenerationParams};
use std::time::{Duration, Instant};

type Failure = Box<dyn std::error::Error>;

struct Args {
    shapes: String,
    tps: Vec<usize>,
    expert_parallel: bool,
    /// Default: `cb` for looped models, `baseline` for diffusion.
    modes: Option<Vec<String>>,
    width: usize,
    prompt: usize,
    new_tokens: usize,
    repeats: usize,
    mean_unmask: f64,
    cuda: bool,
    json: Option<String>,
    commit: String,
}

fn parse() -> Result<Args, Failure> {
    let mut a = Args {
        shapes: "tiny-ouro".into(),
        tps: vec![1, 2],
        expert_parallel: false,
        modes: None,
        width: 64,
        prompt: 128,
        new_tokens: 128,
        repeats: 2,
        mean_unmask: 3.2,
        cuda: false,
        json: None,
        commit: "unknown".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--shapes" => a.shapes = val()?,
            "--tp" => a.tps = val()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--expert-parallel" => a.expert_parallel = true,
            "--modes" => a.modes = Some(val()?.split(',').map(String::from).collect()),
            "--width" => a.width = val()?.parse()?,
            "--prompt" => a.prompt = val()?.parse()?,
            "--new-tokens" => a.new_tokens = val()?.parse()?,
            "--repeats" => a.repeats = val()?.parse()?,
            "--mean-unmask" => a.mean_unmask = val()?.parse()?,
            "--cuda" => a.cuda = true,
            "--json" => a.json = Some(val()?),
            "--commit" => a.commit = val()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if a.tps.is_empty() || a.tps.contains(&0) || a.width == 0 || a.repeats == 0 {
        return Err("--tp takes ranks >= 1; --width and --repeats must be > 0".into());
    }
    Ok(a)
}

/// Tensor names and shapes, as the `testing` manifests list them.
type Manifest = Vec<(String, Vec<usize>)>;

/// The config and manifest of `shapes`.
fn shapes(name: &str) -> Result<(ModelConfig, Manifest), Failure> {
    use ponder::testing::*;
    Ok(match name {
        "ouro-1.4b" => (ModelConfig::Ouro(OuroConfig::ouro_1_4b()), ouro_tensor_manifest(&OuroConfig::ouro_1_4b())),
        "sdar-8b" => (ModelConfig::Sdar(SdarConfig::sdar_8b_chat_b32()), sdar_tensor_manifest(&SdarConfig::sdar_8b_chat_b32())),
        "llada2-mini" => (ModelConfig::Llada2(Llada2Config::llada2_mini()), llada2_tensor_manifest(&Llada2Config::llada2_mini())),
        "llada2-flash" => (ModelConfig::Llada2(Llada2Config::llada2_flash()), llada2_tensor_manifest(&Llada2Config::llada2_flash())),
        "tiny-ouro" => {
            let c = OuroConfig { num_key_value_heads: Some(4), ..tiny_ouro_config(512) };
            (ModelConfig::Ouro(c.clone()), ouro_tensor_manifest(&c))
        }
        "tiny-sdar" => (ModelConfig::Sdar(tiny_sdar_config(512)), sdar_tensor_manifest(&tiny_sdar_config(512))),
        other => return Err(format!("--shapes {other}: ouro-1.4b | sdar-8b | llada2-mini | llada2-flash | tiny-ouro | tiny-sdar").into()),
    })
}

/// One measurement: tokens/s and the mean launch time of the measured stage.
struct Run {
    tokens_per_s: f64,
    step_ms: f64,
    launches: u64,
}

fn run_once(a: &Args, tp: usize, mode: &str, seed: u64) -> Result<Run, Failure> {
    let (config, manifest) = shapes(&a.shapes)?;
    let looped = matches!(config, ModelConfig::Ouro(_));
    let vocab = match &config {
        ModelConfig::Ouro(c) => c.vocab_size,
        ModelConfig::Sdar(c) => c.vocab_size - 1,
        ModelConfig::Llada2(c) => c.vocab_size - 300,
        _ => unreachable!("shapes() makes these three"),
    };
    let (device, dtype) = if a.cuda { (Device::new_cuda(0)?, DType::BF16) } else { (Device::Cpu, DType::F32) };
    let make = move |dev: &Device, dtype: DType| Ok(ponder::testing::lazy_random_weights(&manifest, 7, dtype, dev));
    let mut b = EngineBuilder::from_weights(config, make, None, vec![]).device(device).dtype(dtype).tensor_parallel(tp).max_num_seqs(a.width);
    if a.expert_parallel && tp > 1 {
        b = b.expert_parallel(true);
    }
    // Room for the prompt, the generation and a block past it, in whole 32-token blocks.
    let per_request = (a.prompt + a.new_tokens + 64).next_multiple_of(32);
    b = b.max_num_batched_tokens((a.width * a.prompt).clamp(per_request, 16384)).max_model_len(per_request);
    if looped {
        b = b.kv_capacity_tokens(a.width * per_request * 4);
        b = match mode {
            "cb" => b,
            "cdb-refill" => {
                use ponder::looped::gate::{DepthTrace, Replay};
                let gate = Replay::new(DepthTrace::with_mean(2.5, 1, 4, 5)?, 1, 4)?;
                b.looped(move |o| {
                    o.scheduler(ponder::SchedulerKind::Depth { refill: true }).kv_layout(ponder::KvLayoutKind::LastExited).exit_gate(gate).overlap(true)
                })
            }
            other => return Err(format!("--modes {other}: cb | cdb-refill").into()),
        };
    } else {
        let trace = ponder::diffusion::UnmaskTrace::with_realised_mean(a.mean_unmask, 32, 2026)?;
        let (delayed, focus) = match mode {
            "baseline" => (false, None),
            "baseline-delayed" => (true, None),
            "focus" => (true, Some(ponder::diffusion::Focus::default())),
            other => return Err(format!("--modes {other}: baseline | baseline-delayed | focus").into()),
        };
        b = b.kv_capacity_tokens(a.width * per_request).diffusion(move |o| {
            let o = o.block_length(32).max_steps_per_block(32).delayed_cache(delayed).unmask_policy(ponder::diffusion::Replay::new(trace));
            match focus {
                Some(f) => o.eviction_policy(f),
                None => o,
            }
        });
    }
    let mut engine = b.build()?;
    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(a.new_tokens) };
    let prompts = |s: u64| (0..a.width).map(|i| ponder::bench::random_ids(a.prompt, vocab, s * 1000 + i as u64)).collect::<Vec<_>>();
    // Warm-up: kernels loaded, graphs captured, allocator primed.
    ponder::bench::served_in_full(engine.generate(prompts(999), &GenerationParams { ignore_eos: true, ..GenerationParams::greedy(8) })?, 8)?;
    let before = engine.metrics().clone();
    let started = Instant::now();
    ponder::bench::served_in_full(engine.generate(prompts(seed), &params)?, a.new_tokens)?;
    let wall = started.elapsed().as_secs_f64();
    let stage = match (looped, mode) {
        (true, "cb") => "decode",
        (true, _) => "core",
        (false, _) => "denoise",
    };
    let get = |m: &ponder::EngineMetrics| m.stages.get(stage).cloned().unwrap_or_default();
    let (x, y) = (get(&before), get(engine.metrics()));
    let (time, launches) = ((y.time - x.time).as_secs_f64(), y.launches - x.launches);
    // CB: decode rows over decode time (each decode row is one token); depth batching and
    // diffusion: every generated token over the whole run.
    let tokens_per_s = if looped && mode == "cb" { (y.rows - x.rows) as f64 / time } else { (a.width * a.new_tokens) as f64 / wall };
    Ok(Run { tokens_per_s, step_ms: 1e3 * time / launches.max(1) as f64, launches })
}

/// Mean time of one all-reduce of `[rows, hidden]` in the model dtype over `world` ranks, and
/// its bus bandwidth (NCCL's convention: 2 (n − 1) / n of the buffer per rank).
fn all_reduce_time(a: &Args, world: usize, rows: usize, hidden: usize) -> Result<(f64, f64), Failure> {
    let first = if a.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let dtype = if a.cuda { DType::BF16 } else { DType::F32 };
    let devices = ponder::parallel::rank_devices(&first, world)?;
    let comms = ponder::parallel::group(&devices, Duration::from_secs(120))?;
    // Fewer rounds of a large buffer.
    let iters = if rows * hidden > 1 << 24 { 10 } else { 50 };
    let times: Vec<Result<f64, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(&devices)
            .map(|(c, d)| {
                s.spawn(move || -> Result<f64, String> {
                    let e = |e: &dyn std::fmt::Display| e.to_string();
                    let x = candle_core::Tensor::ones((rows, hidden), dtype, d).map_err(|x| e(&x))?;
                    for _ in 0..5 {
                        c.all_reduce_sum(&x).map_err(|x| e(&x))?;
                    }
                    d.synchronize().map_err(|x| e(&x))?;
                    let started = Instant::now();
                    for _ in 0..iters {
                        c.all_reduce_sum(&x).map_err(|x| e(&x))?;
                    }
                    d.synchronize().map_err(|x| e(&x))?;
                    Ok(started.elapsed().as_secs_f64() / iters as f64)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into()))).collect()
    });
    let t = times.into_iter().collect::<Result<Vec<_>, _>>()?.into_iter().fold(0.0, f64::max);
    let bytes = (rows * hidden * dtype.size_in_bytes()) as f64;
    Ok((t, bytes * 2.0 * (world as f64 - 1.0) / world as f64 / t / 1e9))
}

fn main() -> Result<(), Failure> {
    let a = parse()?;
    let (config, _) = shapes(&a.shapes)?;
    let (hidden, per_step) = match &config {
        // Two all-reduces per layer and loop step (attention, MLP).
        ModelConfig::Ouro(c) => (c.hidden_size, 2 * c.num_hidden_layers * c.total_ut_steps),
        ModelConfig::Sdar(c) => (c.hidden_size, 2 * c.num_hidden_layers),
        ModelConfig::Llada2(c) => (c.hidden_size, 2 * c.num_hidden_layers),
        _ => unreachable!("shapes() makes these three"),
    };
    let modes: Vec<String> = a.modes.clone().unwrap_or_else(|| vec![if matches!(config, ModelConfig::Ouro(_)) { "cb".into() } else { "baseline".into() }]);
    println!(
        "{} · ranks {:?} · W {} · prompt {} · {} new tokens · {}",
        a.shapes,
        a.tps,
        a.width,
        a.prompt,
        a.new_tokens,
        if a.cuda { "CUDA bf16" } else { "CPU f32" }
    );
    println!("{:>8} {:>4} {:>7} {:>12} {:>10} {:>9}", "mode", "tp", "repeat", "tok/s", "step ms", "launches");
    let mut rows = Vec::new();
    for r in 0..a.repeats {
        for mode in &modes {
            for &tp in &a.tps {
                let run = run_once(&a, tp, mode, r as u64)?;
                println!("{mode:>8} {tp:>4} {r:>7} {:>12.1} {:>10.3} {:>9}", run.tokens_per_s, run.step_ms, run.launches);
                rows.push(serde_json::json!({ "mode": mode, "tp": tp, "repeat": r, "tokens_per_s": run.tokens_per_s, "step_ms": run.step_ms, "launches": run.launches }));
            }
        }
    }
    // Each (mode, tp)'s median against tp 1's.
    let median = |mode: &str, tp: usize| {
        let mut v: Vec<f64> = rows.iter().filter(|x| x["mode"] == mode && x["tp"] == tp).filter_map(|x| x["tokens_per_s"].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let mut summary = Vec::new();
    for mode in &modes {
        for &tp in &a.tps {
            let (m, one) = (median(mode, tp), median(mode, 1));
            if let (Some(m), Some(one)) = (m, one) {
                println!("{mode} tp {tp}: {m:.1} tok/s, {:.2}× one device", m / one);
                summary.push(serde_json::json!({ "mode": mode, "tp": tp, "median_tokens_per_s": m, "speedup": m / one }));
            }
        }
    }
    let mut collectives = Vec::new();
    for &tp in a.tps.iter().filter(|&&t| t > 1) {
        let (t, bus) = all_reduce_time(&a, tp, a.width, hidden)?;
        // The collective's own peak on this machine: a buffer large enough that latency does
        // not count (1 GiB in bf16 on GPUs, as nccl-tests quote it; 16 MiB of f32 on the CPU).
        let big_rows = if a.cuda { (1 << 29) / hidden } else { (1 << 22) / hidden };
        let (_, peak) = all_reduce_time(&a, tp, big_rows, hidden)?;
        println!(
            "all-reduce [{}, {hidden}] over {tp}: {:.1} µs, bus {bus:.1} GB/s ({:.0} % of the {peak:.1} GB/s a large buffer reaches); {per_step} per decode step = {:.3} ms",
            a.width,
            t * 1e6,
            100.0 * bus / peak,
            per_step as f64 * t * 1e3
        );
        collectives.push(serde_json::json!({
            "tp": tp, "rows": a.width, "hidden": hidden, "seconds": t, "bus_gb_s": bus, "peak_bus_gb_s": peak,
            "per_step": per_step, "per_step_ms": per_step as f64 * t * 1e3,
        }));
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "bench": "bench_parallel", "shapes": a.shapes, "width": a.width, "prompt": a.prompt, "new_tokens": a.new_tokens,
            "expert_parallel": a.expert_parallel, "gpu": ponder::bench::gpu_name(), "commit": a.commit,
            "command": std::env::args().collect::<Vec<_>>().join(" "), "runs": rows, "summary": summary, "all_reduce": collectives,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
