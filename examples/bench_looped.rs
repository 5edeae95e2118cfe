//! Throughput of looped-LM serving on real model shapes with random weights generated on the
//! device (real checkpoints cannot be downloaded here; the CDB authors' method).
//!
//!     bench_looped [--model ouro|huginn] [--suite cb|cdb] [--widths 16,64,256] [--layout L]
//!                  [--json FILE] [--commit SHA] [--parity] [--tiny]
//!       suite cb:  [--prompt-len 128] [--new-tokens 256] [--repeats 3]
//!       suite cdb: [--mean-depths 2.5,3.0] [--modes cb,cdb-no-refill,cdb-refill]
//!                  [--requests-per-width 3] [--min-depth 2] [--kv-gb 40] [--min-coda 1,quarter,half,full]
//!                  [--coda-reserve 0,parked] [--coda-pairs quarter:0,half:parked]
//!                  [--prompt-median 128] [--prompt-max 512] [--output-median 160] [--output-max 256]
//!                  [--overlap off,on] [--repeats 1] [--time-device]
//!
//! `--model huginn` runs Huginn-0125 shapes (3.5B, r_max 16) instead of Ouro-1.4B;
//! `--min-coda 1,quarter` compares a coda held for 1 exited token with one held for W/4;
//! `--coda-reserve 0,parked` runs refill with the paper's resident cap (W) and with W plus
//! min coda − 1 resident requests (launches still at most W rows), so tokens parked for the
//! held coda do not leave the core launch short (`--coda-pairs` lists (min coda, reserve)
//! pairs instead of every combination);
//! `--overlap off,on` runs depth batching with synchronous result reads and with launch N+1
//! issued before N's results are read (`Engine::set_overlap`).
//!
//! Suite `cb`: for each width W, W requests at once (random prompt ids, eos ignored) with the
//! full-depth continuous batching baseline; decode tokens/s (median over repeats, after a
//! warm-up) next to the weight-streaming floor (bytes of weights one decode step reads ÷ the
//! measured device copy bandwidth).
//!
//! Suite `cdb`: CB vs depth batching without and with refill on one workload per width:
//! `requests-per-width × W` requests with ShareGPT-like lengths (prompt ~ lognormal, median 128,
//! σ 0.9, clipped to 8..512; output ~ lognormal, median 160, σ 0.7, clipped to 8..256; medians
//! and maxima set by `--prompt-median` … `--output-max`, recorded as `workload` in the JSON), exit
//! depths replayed from a seeded distribution over `min-depth..=r_max` with the given mean.
//! Offline throughput over the steady-state window (opens after W completions, closes at the
//! last admission; the whole run if that window is shorter than 20 % of it), speed-up over CB,
//! the FLOP bound for the realised mean depth, the fraction of the bound achieved, and the GPU
//! idle share: exact with `--time-device` (`idle=`: 1 − device spans ÷ run wall time), else an
//! upper bound over the launches (host time not blocked on the device). With `--repeats N` each
//! configuration runs N times on one engine after its warm-up and the median run is reported
//! (every run's tokens/s is kept in the JSON); by default once. `--time-device` records each
//! launch's device-side span with stream events (`EngineBuilder::time_device`): per stage in the
//! JSON (`device_s`, of it `device_forward_s` in the model's forward, the rest sampling,
//! re-entry and result copies) and printed, exact under overlap where the host's wait is not.
//! Each depth-batching row then also gets the prefill-adjusted bound (the paper's realistic
//! ceiling): CB's device time with its decode divided by the FLOP bound and its prefill, full
//! depth in every mode, unchanged; and the share of it reached.
//!
//! `--parity` first compares next-token logits of the bf16 CUDA model with the f32 CPU reference
//! on the same weights. `--tiny` runs a tiny config on the CPU (a smoke test of this binary).

use candle_core::{DType, Device, Tensor};
use ponder::engine::LoopedRunner;
use ponder::kv::{KvLayout, KvManager};
use ponder::loader::Weights;
use ponder::models::looped::{Huginn, Ouro};
use ponder::models::{HuginnConfig, LoopedModel, OuroConfig};
use ponder::scheduler::{Launch, LaunchRow, Stage};
use ponder::testing::{huginn_tensor_manifest, ouro_tensor_manifest, random_tensors, tiny_huginn_config, tiny_ouro_config};
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind, RequestId};
use std::time::Instant;

struct Args {
    widths: Vec<usize>,
    prompt_len: usize,
    new_tokens: usize,
    repeats: usize,
    /// Whether `--repeats` was given (suite cdb runs each configuration once unless it was).
    repeats_set: bool,
    layout: KvLayoutKind,
    json: Option<String>,
    commit: String,
    parity: bool,
    tiny: bool,
    suite: String,
    mean_depths: Vec<f64>,
    modes: Vec<String>,
    requests_per_width: usize,
    min_depth: usize,
    kv_gb: f64,
    model: String,
    min_coda: Vec<String>,
    /// Coda reserves to compare (refill only): numbers, or "parked" for min coda − 1.
    coda_reserve: Vec<String>,
    /// Explicit (min coda, reserve) pairs for refill, instead of the cross product.
    coda_pairs: Vec<String>,
    lengths: Lengths,
    overlap: Vec<bool>,
    /// Record each launch's device-side span (stream events) into the per-stage JSON.
    time_device: bool,
}

fn parse() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        widths: vec![16, 64, 256],
        prompt_len: 128,
        new_tokens: 256,
        repeats: 3,
        repeats_set: false,
        layout: KvLayoutKind::DepthIndexed,
        json: None,
        commit: "unknown".into(),
        parity: false,
        tiny: false,
        suite: "cb".into(),
        mean_depths: vec![2.5, 3.0],
        modes: vec!["cb".into(), "cdb-no-refill".into(), "cdb-refill".into()],
        requests_per_width: 3,
        min_depth: 2,
        kv_gb: 40.0,
        model: "ouro".into(),
        min_coda: vec!["1".into()],
        coda_reserve: vec!["0".into()],
        coda_pairs: Vec::new(),
        lengths: Lengths::default(),
        overlap: vec![false],
        time_device: false,
    };
    let mut layout_set = false;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--widths" => a.widths = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--prompt-len" => a.prompt_len = v()?.parse()?,
            "--new-tokens" => a.new_tokens = v()?.parse()?,
            "--repeats" => {
                a.repeats = v()?.parse()?;
                a.repeats_set = true;
            }
            "--layout" => {
                a.layout = v()?.parse()?;
                layout_set = true;
            }
            "--suite" => a.suite = v()?,
            "--mean-depths" => a.mean_depths = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--modes" => a.modes = v()?.split(',').map(String::from).collect(),
            "--requests-per-width" => a.requests_per_width = v()?.parse()?,
            "--min-depth" => a.min_depth = v()?.parse()?,
            "--kv-gb" => a.kv_gb = v()?.parse()?,
            "--model" => a.model = v()?,
            "--min-coda" => a.min_coda = v()?.split(',').map(String::from).collect(),
            "--coda-reserve" => a.coda_reserve = v()?.split(',').map(String::from).collect(),
            "--coda-pairs" => a.coda_pairs = v()?.split(',').map(String::from).collect(),
            "--prompt-median" => a.lengths.prompt_median = v()?.parse()?,
            "--prompt-max" => a.lengths.prompt_max = v()?.parse()?,
            "--output-median" => a.lengths.output_median = v()?.parse()?,
            "--output-max" => a.lengths.output_max = v()?.parse()?,
            "--overlap" => a.overlap = v()?.split(',').map(|x| x == "on" || x == "true").collect(),
            "--time-device" => a.time_device = true,
            "--json" => a.json = Some(v()?),
            "--commit" => a.commit = v()?,
            "--parity" => a.parity = true,
            "--tiny" => a.tiny = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if a.suite == "cdb" && !layout_set {
        a.layout = KvLayoutKind::Shared; // the CDB default layout; valid for every exit depth
    }
    Ok(a)
}

/// The benchmarked model: real shapes (or a tiny CPU config), random weights.
#[derive(Clone)]
enum BenchModel {
    Ouro(Ouro),
    Huginn(Huginn),
}

impl BenchModel {
    fn boxed(&self) -> Box<dyn LoopedModel> {
        match self {
            Self::Ouro(m) => Box::new(m.clone()),
            Self::Huginn(m) => Box::new(m.clone()),
        }
    }
    fn spec(&self) -> &ponder::models::LoopedSpec {
        match self {
            Self::Ouro(m) => m.spec(),
            Self::Huginn(m) => m.spec(),
        }
    }
}

/// How to make the benchmarked model from a set of weights.
struct ModelRecipe {
    name: &'static str,
    manifest: Vec<(String, Vec<usize>)>,
    load: Box<dyn Fn(&Weights) -> ponder::Result<BenchModel>>,
}

fn recipe(model: &str, tiny: bool) -> Result<ModelRecipe, Box<dyn std::error::Error>> {
    Ok(match (model, tiny) {
        ("ouro", false) | ("ouro", true) => {
            let cfg = if tiny { tiny_ouro_config(512) } else { OuroConfig::ouro_1_4b() };
            ModelRecipe {
                name: if tiny { "tiny-ouro (random)" } else { "Ouro-1.4B shapes, random bf16 weights" },
                manifest: ouro_tensor_manifest(&cfg),
                load: Box::new(move |w| Ok(BenchModel::Ouro(Ouro::load(&cfg, w)?))),
            }
        }
        ("huginn", _) => {
            let cfg = if tiny { tiny_huginn_config(512) } else { HuginnConfig::huginn_0125() };
            ModelRecipe {
                name: if tiny { "tiny-huginn (random)" } else { "Huginn-0125 (3.5B) shapes, r_max 16, random bf16 weights" },
                manifest: huginn_tensor_manifest(&cfg),
                load: Box::new(move |w| Ok(BenchModel::Huginn(Huginn::load(&cfg, w)?))),
            }
        }
        (other, _) => return Err(format!("unknown model {other} (ouro | huginn)").into()),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    let (device, dtype) = if args.tiny { (Device::Cpu, DType::F32) } else { (Device::new_cuda(0)?, DType::BF16) };
    let recipe = recipe(&args.model, args.tiny)?;
    let gpu = gpu_name();
    println!("device: {gpu}; model: {}", recipe.name);

    let mut parity_json = serde_json::Value::Null;
    if args.parity {
        parity_json = parity(&recipe, &device, dtype)?;
    }

    let t = Instant::now();
    let master = random_tensors(&recipe.manifest, 7, DType::F32, &device)?;
    let model = (recipe.load)(&Weights::from_map(master, dtype, &device))?;
    device.synchronize()?;
    println!("random weights generated on the device in {:.1}s", t.elapsed().as_secs_f64());
    let spec = model.spec().clone();
    let weight_bytes_per_step = (spec.max_steps as u64 * spec.step_params + spec.boundary_params) * dtype.size_in_bytes() as u64;
    let bandwidth = copy_bandwidth(&device)?;
    println!("copy bandwidth {:.0} GB/s; weights read per decode step {:.2} GB", bandwidth / 1e9, weight_bytes_per_step as f64 / 1e9);

    let results = if args.suite == "cdb" { cdb_suite(&args, &model)? } else { cb_suite(&args, &model, bandwidth, weight_bytes_per_step)? };
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "gpu": gpu, "commit": args.commit,
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "model": recipe.name,
            "suite": args.suite, "layout": format!("{:?}", args.layout),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "workload": if args.suite == "cdb" { args.lengths.json() } else { serde_json::Value::Null },
            "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes_per_decode_step": weight_bytes_per_step,
            "f0_over_fr": spec.boundary_params as f64 / spec.step_params as f64,
            "parity": parity_json, "results": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        println!("wrote {path}");
    }
    Ok(())
}

fn cb_suite(args: &Args, model: &BenchModel, bandwidth: f64, weight_bytes_per_step: u64) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    let spec = model.spec().clone();
    let mut results = Vec::new();
    println!("{:>6} {:>12} {:>12} {:>10} {:>12} {:>10}", "width", "tok/s", "floor tok/s", "of floor", "step ms", "prefill s");
    for &w in &args.widths {
        let slots = args.layout.build().num_slots(spec.max_steps);
        let per_req = args.prompt_len + args.new_tokens + 16;
        let engine_for = |model: &BenchModel| {
            EngineBuilder::from_model(model.boxed(), None, vec![])
                .kv_layout(args.layout)
                .max_num_seqs(w)
                .max_num_batched_tokens((w * args.prompt_len).clamp(per_req, 16384))
                .kv_capacity_tokens(w * per_req * slots)
                .build()
        };
        let mut engine = engine_for(model)?;
        let run = |engine: &mut ponder::Engine, new_tokens: usize, seed: u64| -> Result<(f64, f64, f64), Box<dyn std::error::Error>> {
            let before = engine.metrics().clone();
            let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(new_tokens) };
            let prompts: Vec<Vec<u32>> = (0..w).map(|i| random_ids(args.prompt_len, spec.vocab_size, seed * 1000 + i as u64)).collect();
            for o in engine.generate(prompts, &params)? {
                assert_eq!(o?.token_ids.len(), new_tokens);
            }
            let m = engine.metrics();
            let dec = delta(&before, m, "decode");
            let pre = delta(&before, m, "prefill");
            Ok((dec.1 as f64 / dec.0, dec.0 / dec.2 as f64, pre.0))
        };
        run(&mut engine, 8, 999)?; // warm-up: kernels loaded, allocator primed
        let mut samples = Vec::new();
        for r in 0..args.repeats {
            samples.push(run(&mut engine, args.new_tokens, r as u64)?);
        }
        samples.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (tps, step_s, prefill_s) = samples[samples.len() / 2];
        let floor = w as f64 * bandwidth / weight_bytes_per_step as f64;
        println!("{w:>6} {tps:>12.0} {floor:>12.0} {:>9.1}% {:>12.2} {prefill_s:>10.2}", 100.0 * tps / floor, step_s * 1e3);
        results.push(serde_json::json!({
            "mode": "cb", "layout": format!("{:?}", args.layout), "width": w,
            "tokens_per_s": tps, "floor_tokens_per_s": floor, "decode_step_ms": step_s * 1e3,
            "prefill_s": prefill_s, "repeats": samples.iter().map(|s| s.0).collect::<Vec<_>>(),
        }));
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

fn random_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// Device-to-device copy bandwidth (bytes read + written per second), median of 10.
fn copy_bandwidth(device: &Device) -> candle_core::Result<f64> {
    let n = if device.is_cpu() { 1 << 24 } else { 1 << 30 };
    let x = Tensor::ones(n, DType::BF16, device)?;
    let _ = x.copy()?;
    device.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let y = x.copy()?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
        drop(y);
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n * 2) as f64 / times[5])
}

fn gpu_name() -> String {
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "cpu".into())
}

/// Next-token logits of the device model (in `dtype`) vs the f32 CPU reference on the same
/// weights: a prefill of 4 ragged prompts, then one decode step.
fn parity(recipe: &ModelRecipe, device: &Device, dtype: DType) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let t = Instant::now();
    let master = random_tensors(&recipe.manifest, 11, DType::F32, device)?;
    let cpu: std::collections::HashMap<_, _> = master.iter().map(|(k, v)| Ok((k.clone(), v.to_device(&Device::Cpu)?))).collect::<candle_core::Result<_>>()?;
    let dev_model = (recipe.load)(&Weights::from_map(master, dtype, device))?;
    let cpu_model = (recipe.load)(&Weights::from_map(cpu, DType::F32, &Device::Cpu))?;
    let steps = cpu_model.spec().max_steps;
    let block = 16;
    let lens = [5usize, 17, 33, 9];
    let layout: Box<dyn KvLayout> = KvLayoutKind::DepthIndexed.build();
    let num_blocks = 4 * steps * 8;
    let mut kv = KvManager::new(num_blocks, block, layout, steps);
    let dev_runner = LoopedRunner::new(dev_model.boxed(), num_blocks, block, 0)?;
    let cpu_runner = LoopedRunner::new(cpu_model.boxed(), num_blocks, block, 0)?;
    let step_slots: Vec<usize> = (0..steps).collect();
    let prompts: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| random_ids(n, cpu_model.spec().vocab_size, 50 + i as u64)).collect();
    let rows = |toks: &[Vec<u32>], start: &[usize], kv: &mut KvManager| -> Vec<LaunchRow> {
        toks.iter()
            .zip(start)
            .enumerate()
            .map(|(i, (t, &s))| {
                assert!(kv.reserve(RequestId(i as u64), s + t.len()));
                LaunchRow::full_depth(RequestId(i as u64), t.clone(), s, kv.tables(RequestId(i as u64)).unwrap().to_vec())
            })
            .collect()
    };
    let prefill = Launch { stage: Stage::Prefill, step_slots: step_slots.clone(), rows: rows(&prompts, &[0; 4], &mut kv), kv_copies: vec![], reenter: false };
    let mut report = Vec::new();
    let mut next: Vec<Vec<u32>> = Vec::new();
    for (name, launch) in [("prefill", prefill)] {
        let (a, b) = (dev_runner.forward(&launch)?, cpu_runner.forward(&launch)?);
        report.push(compare(name, &a, &b)?);
        next = b.logits.unwrap().argmax(1)?.to_vec1::<u32>()?.into_iter().map(|t| vec![t]).collect();
    }
    let decode = Launch { stage: Stage::FullDepthDecode, step_slots, rows: rows(&next, &lens, &mut kv), kv_copies: vec![], reenter: false };
    let (a, b) = (dev_runner.forward(&decode)?, cpu_runner.forward(&decode)?);
    report.push(compare("decode", &a, &b)?);
    println!("parity done in {:.1}s", t.elapsed().as_secs_f64());
    Ok(serde_json::Value::Array(report))
}

fn compare(name: &str, dev: &ponder::engine::Forward, cpu: &ponder::engine::Forward) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let rel = |a: &Tensor, b: &Tensor| -> candle_core::Result<f64> {
        let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
        let b = b.to_dtype(DType::F64)?;
        let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
        Ok(num / b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt())
    };
    let (la, lb) = (dev.logits.as_ref().unwrap(), cpu.logits.as_ref().unwrap());
    let logits_rel = rel(la, lb)?;
    let gate_rel = match (&dev.gate_logits, &cpu.gate_logits) {
        (Some(a), Some(b)) => rel(a, b)?,
        _ => f64::NAN, // the model has no exit gate (Huginn)
    };
    let am_a = la.to_device(&Device::Cpu)?.argmax(1)?.to_vec1::<u32>()?;
    let am_b = lb.argmax(1)?.to_vec1::<u32>()?;
    let agree = am_a.iter().zip(&am_b).filter(|(x, y)| x == y).count();
    println!("parity {name}: logits rel err {logits_rel:.2e}, gate-logit rel err {gate_rel:.2e}, argmax agree {agree}/{}", am_b.len());
    Ok(serde_json::json!({ "stage": name, "logits_rel_err": logits_rel, "gate_logits_rel_err": gate_rel, "argmax_agree": agree, "rows": am_b.len() }))
}

/// A request of the cdb workload.
struct Job {
    prompt: Vec<u32>,
    new_tokens: usize,
}

fn lognormal(median: f64, sigma: f64, lo: usize, hi: usize, x: &mut u64) -> usize {
    let mut uniform = || {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        ((*x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let z = (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos();
    ((median * (sigma * z).exp()).round() as usize).clamp(lo, hi)
}

/// Lengths of the suite-cdb workload: lognormal prompt and output lengths (median, σ, clipped
/// to 8..=max). The defaults are ShareGPT-like with short outputs: about half of all tokens are
/// prompt tokens, which run full depth in every mode.
#[derive(Debug, Clone, Copy)]
struct Lengths {
    prompt_median: f64,
    prompt_max: usize,
    output_median: f64,
    output_max: usize,
}

impl Default for Lengths {
    fn default() -> Self {
        Self { prompt_median: 128.0, prompt_max: 512, output_median: 160.0, output_max: 256 }
    }
}

impl Lengths {
    const PROMPT_SIGMA: f64 = 0.9;
    const OUTPUT_SIGMA: f64 = 0.7;

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt": { "median": self.prompt_median, "sigma": Self::PROMPT_SIGMA, "min": 8, "max": self.prompt_max },
            "output": { "median": self.output_median, "sigma": Self::OUTPUT_SIGMA, "min": 8, "max": self.output_max },
        })
    }
}

fn workload(n: usize, vocab: usize, max_context: usize, seed: u64, len: Lengths) -> Vec<Job> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            let p = lognormal(len.prompt_median, Lengths::PROMPT_SIGMA, 8, len.prompt_max.min(max_context / 2), &mut x);
            let o = lognormal(len.output_median, Lengths::OUTPUT_SIGMA, 8, len.output_max.min(max_context / 2), &mut x);
            Job { prompt: random_ids(p, vocab, seed ^ (i as u64 + 1) * 7919), new_tokens: o }
        })
        .collect()
}

/// Outcome of one offline run.
struct RunStats {
    window_tokens_per_s: f64,
    whole_tokens_per_s: f64,
    mean_depth: f64,
    /// GPU idle share of the run: exact from device spans (`idle_exact`), else an upper bound
    /// over the launches from the host's waits.
    idle: f64,
    idle_exact: bool,
    stages: serde_json::Value,
}

/// Device seconds of one stage in a run's `stages` JSON (with `--time-device`).
fn stage_device(stages: &serde_json::Value, name: &str) -> Option<f64> {
    stages.get(name)?.get("device_s")?.as_f64()
}

/// Runs `jobs` offline (all queued at once) and measures the steady-state window.
fn offline(engine: &mut ponder::Engine, jobs: &[Job], width: usize) -> Result<RunStats, Box<dyn std::error::Error>> {
    let before = engine.metrics().clone();
    for j in jobs {
        let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(j.new_tokens) };
        engine.add_request(j.prompt.clone(), params)?;
    }
    let start = Instant::now();
    let (mut tokens, mut done) = (0u64, 0usize);
    let mut window_open: Option<(Instant, u64)> = None;
    let mut window: Option<(f64, u64)> = None;
    while engine.has_work() {
        for ev in engine.step()? {
            match ev {
                ponder::Event::Token { .. } => tokens += 1,
                ponder::Event::Finished { .. } => done += 1,
            }
        }
        if window_open.is_none() && done >= width {
            window_open = Some((Instant::now(), tokens));
        }
        if window.is_none() && engine.scheduler().num_waiting() == 0 {
            if let Some((t0, k0)) = window_open {
                window = Some((t0.elapsed().as_secs_f64(), tokens - k0));
            }
        }
    }
    let total = start.elapsed().as_secs_f64();
    let whole = tokens as f64 / total;
    let win = match window {
        Some((secs, k)) if secs >= 0.2 * total => k as f64 / secs,
        _ => whole,
    };
    let m = engine.metrics();
    let mut stages = serde_json::Map::new();
    let mut wait = 0.0;
    let mut time = 0.0;
    let mut device_total = 0.0;
    let mut all_timed = !m.stages.is_empty();
    for (name, s) in &m.stages {
        let b = before.stages.get(name).cloned().unwrap_or_default();
        let (t, w) = ((s.time - b.time).as_secs_f64(), (s.wait - b.wait).as_secs_f64());
        time += t;
        wait += w;
        let device = (s.device_time - b.device_time).as_secs_f64();
        let forward = (s.device_forward - b.device_forward).as_secs_f64();
        let timed = s.device_timed - b.device_timed == s.launches - b.launches;
        all_timed &= timed;
        device_total += device;
        stages.insert(
            name.to_string(),
            serde_json::json!({ "launches": s.launches - b.launches, "rows": s.rows - b.rows, "seconds": t, "device_wait_s": w,
                                "device_s": timed.then_some(device), "device_forward_s": timed.then_some(forward) }),
        );
    }
    let hist: Vec<u64> = m.depth_histogram.iter().zip(before.depth_histogram.iter().chain(std::iter::repeat(&0))).map(|(a, b)| a - b).collect();
    let n: u64 = hist.iter().sum();
    let mean_depth = if n == 0 { 0.0 } else { hist.iter().enumerate().map(|(i, c)| (i as u64 + 1) * c).sum::<u64>() as f64 / n as f64 };
    // With device spans the idle share is exact: the device works only inside launch spans.
    let idle = if all_timed {
        1.0 - device_total / total
    } else if time > 0.0 {
        1.0 - wait / time
    } else {
        0.0
    };
    Ok(RunStats { window_tokens_per_s: win, whole_tokens_per_s: whole, mean_depth, idle, idle_exact: all_timed, stages: stages.into() })
}

fn cdb_suite(args: &Args, model: &BenchModel) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    use ponder::gate::{DepthTrace, Replay};
    use ponder::SchedulerKind;
    let spec = model.spec().clone();
    let slots = args.layout.build().num_slots(spec.max_steps);
    let bytes_per_pos = ponder::kv::KvStore::bytes_per_block(spec.num_kv_layers, 1, spec.num_kv_heads, spec.head_dim, spec.dtype) * slots;
    let mut results = Vec::new();
    println!("{:>5} {:>6} {:>20} {:>10} {:>8} {:>7} {:>7} {:>8} {:>7}", "width", "d̄", "mode", "tok/s", "vs CB", "bound", "of bnd", "idle", "d̄ real");
    for &w in &args.widths {
        let jobs = workload(args.requests_per_width * w, spec.vocab_size, spec.max_context, 42 + w as u64, args.lengths);
        let max_need = jobs.iter().map(|j| j.prompt.len() + j.new_tokens).max().unwrap_or(1) + 16;
        // Room for the most resident requests any variant admits (a coda reserve adds some).
        let most_resident = w + w.max(4);
        let kv_tokens = ((args.kv_gb * 1e9) as usize / bytes_per_pos).min(most_resident * max_need) * slots;
        let build = |sched: SchedulerKind, mean: f64, min_coda: usize, reserve: usize| -> ponder::Result<ponder::Engine> {
            let b = EngineBuilder::from_model(model.boxed(), None, vec![])
                .kv_layout(args.layout)
                .scheduler(sched)
                .max_num_seqs(w)
                .max_num_batched_tokens(8192)
                .kv_capacity_tokens(kv_tokens)
                .min_coda_batch_size(min_coda)
                .coda_reserve(reserve)
                .time_device(args.time_device);
            match sched {
                SchedulerKind::Continuous => b.build(),
                _ => b.exit_gate(Replay::new(DepthTrace::with_mean(mean, args.min_depth, spec.max_steps, 5)?, args.min_depth, spec.max_steps)?).build(),
            }
        };
        let warm = workload(w.min(32), spec.vocab_size, spec.max_context, 1, Lengths::default()).into_iter().map(|j| Job { new_tokens: 8, ..j }).collect::<Vec<_>>();
        let mut cb_tps = None;
        // CB's device seconds in (prefill, decode), for the prefill-adjusted bound.
        let mut cb_device: Option<(f64, f64)> = None;
        // Min coda batch sizes to compare: numbers, "quarter" (W/4), "half" (W/2) or "full" (W); reserves:
        // numbers or "parked" (min coda − 1).
        let coda_size = |m: &str| match m {
            "quarter" => Ok((w / 4).max(1)),
            "half" => Ok((w / 2).max(1)),
            "full" => Ok(w),
            n => n.parse::<usize>(),
        };
        let reserve_size = |r: &str, m: usize| if r == "parked" { Ok(m - 1) } else { r.parse::<usize>() };
        // (min coda, reserve) pairs of refill: `--coda-pairs`, else every min coda × reserve.
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        if args.coda_pairs.is_empty() {
            for m in &args.min_coda {
                let m = coda_size(m)?;
                for r in &args.coda_reserve {
                    pairs.push((m, reserve_size(r, m)?));
                }
            }
        } else {
            for pair in &args.coda_pairs {
                let (m, r) = pair.split_once(':').ok_or_else(|| format!("--coda-pairs entry {pair} is not MIN_CODA:RESERVE"))?;
                let m = coda_size(m)?;
                pairs.push((m, reserve_size(r, m)?));
            }
        }
        let mut seen = std::collections::HashSet::new();
        pairs.retain(|p| seen.insert(*p));
        let mut seen = std::collections::HashSet::new();
        let min_codas: Vec<usize> = pairs.iter().map(|p| p.0).filter(|m| seen.insert(*m)).collect();
        for (di, &mean) in args.mean_depths.iter().enumerate() {
            for mode in &args.modes {
                let sched: SchedulerKind = mode.parse()?;
                // No-refill holds every resident request in its wave: no reserve.
                let sched_pairs: Vec<(usize, usize)> =
                    if sched == (SchedulerKind::Depth { refill: true }) { pairs.clone() } else { min_codas.iter().map(|&m| (m, 0)).collect() };
                let variants: Vec<(usize, usize, bool)> = if sched == SchedulerKind::Continuous {
                    vec![(min_codas[0], 0, false)]
                } else {
                    sched_pairs.iter().flat_map(|&(m, r)| args.overlap.iter().map(move |&o| (m, r, o))).collect()
                };
                for (min_coda, reserve, overlap) in variants {
                    if sched == SchedulerKind::Continuous && di > 0 {
                        // CB runs full depth whatever the exit distribution: measured once per width.
                        let prev = results.iter().rev().find(|r: &&serde_json::Value| r["mode"] == "cb" && r["width"] == w).cloned();
                        if let Some(mut r) = prev {
                            r["mean_depth"] = mean.into();
                            r["target_mean_depth"] = mean.into();
                            r["flop_bound"] = spec.flop_bound(mean).into();
                            results.push(r);
                        }
                        continue;
                    }
                    let mut engine = build(sched, mean, min_coda, reserve)?;
                    engine.set_overlap(overlap)?;
                    offline(&mut engine, &warm, w)?;
                    // Repeats on the same engine (graphs captured by then); the median run by
                    // window tokens/s is reported, every run's figure is kept.
                    let n = if args.repeats_set { args.repeats.max(1) } else { 1 };
                    let mut runs = (0..n).map(|_| offline(&mut engine, &jobs, w)).collect::<Result<Vec<_>, _>>()?;
                    runs.sort_by(|a, b| a.window_tokens_per_s.total_cmp(&b.window_tokens_per_s));
                    let all_tps: Vec<f64> = runs.iter().map(|r| r.window_tokens_per_s).collect();
                    let st = runs.swap_remove(n / 2);
                    let realised = if sched == SchedulerKind::Continuous { spec.max_steps as f64 } else { st.mean_depth };
                    let bound = spec.flop_bound(realised);
                    if sched == SchedulerKind::Continuous {
                        cb_tps = Some(st.window_tokens_per_s);
                        cb_device = stage_device(&st.stages, "prefill").zip(stage_device(&st.stages, "decode"));
                    }
                    let speedup = cb_tps.map(|c| st.window_tokens_per_s / c);
                    // On the CPU (`--tiny`) the host is the device: no idle share to speak of.
                    let idle = (!args.tiny).then_some(st.idle);
                    // The paper's realistic ceiling: CB's device time with its decode divided by
                    // the FLOP bound and its prefill (full depth in every mode) unchanged.
                    let adjusted = cb_device.filter(|_| sched != SchedulerKind::Continuous).map(|(p, d)| (p + d) / (p + d / bound));
                    let mut label = mode.clone();
                    if min_codas.len() > 1 && sched != SchedulerKind::Continuous {
                        label += &format!("/coda{min_coda}");
                    }
                    if reserve > 0 {
                        label += &format!("/res{reserve}");
                    }
                    if overlap {
                        label += "/overlap";
                    }
                    println!(
                        "{w:>5} {mean:>6.2} {label:>20} {:>10.0} {:>8} {bound:>7.3} {:>7} {:>8}{} {realised:>7.2}",
                        st.window_tokens_per_s,
                        speedup.map_or("-".into(), |s| format!("{s:.3}x")),
                        speedup.map_or("-".into(), |s| format!("{:.1}%", 100.0 * s / bound)),
                        idle.map_or("-".into(), |i| format!("{:.1}%", 100.0 * i)),
                        if st.idle_exact { "=" } else { " " }
                    );
                    if let (Some(a), Some(s)) = (adjusted, speedup) {
                        println!("{:>14} prefill-adjusted bound {a:.3}x: {:.1}% of it", "", 100.0 * s / a);
                    }
                    if args.time_device {
                        let parts: Vec<String> = st
                            .stages
                            .as_object()
                            .into_iter()
                            .flatten()
                            .filter_map(|(k, v)| {
                                let f = v["device_forward_s"].as_f64().unwrap_or(0.0);
                                v["device_s"].as_f64().map(|d| format!("{k} {d:.2} s (forward {f:.2}) / {} launches", v["launches"]))
                            })
                            .collect();
                        if !parts.is_empty() {
                            println!("{:>14} device time: {}", "", parts.join(" · "));
                        }
                    }
                    results.push(serde_json::json!({
                        "mode": mode, "width": w, "min_coda_batch_size": min_coda, "coda_reserve": reserve, "overlap": overlap,
                        "mean_depth": if sched == SchedulerKind::Continuous { mean } else { realised },
                        "target_mean_depth": mean, "tokens_per_s": st.window_tokens_per_s, "tokens_per_s_whole_run": st.whole_tokens_per_s,
                        "speedup_vs_cb": speedup, "flop_bound": spec.flop_bound(if sched == SchedulerKind::Continuous { mean } else { realised }),
                        "fraction_of_bound": speedup.map(|s| s / spec.flop_bound(realised)), "gpu_idle": idle, "gpu_idle_exact": st.idle_exact,
                        "requests": jobs.len(), "stages": st.stages, "repeats_tokens_per_s": all_tps,
                        "prefill_adjusted_bound": adjusted, "fraction_of_prefill_adjusted_bound": adjusted.zip(speedup).map(|(a, s)| s / a),
                    }));
                }
            }
        }
    }
    Ok(results)
}
