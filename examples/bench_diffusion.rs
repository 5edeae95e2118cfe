//! Throughput of block-diffusion serving on SDAR-8B shapes with random bf16 weights generated
//! on the device and replayed unmask counts (real checkpoints cannot be downloaded here).
//!
//!     bench_diffusion [--model sdar|llada|llada2-mini] [--batches 32,64,128,256] [--modes baseline,baseline-delayed,focus]
//!                     [--block 32] [--new-tokens 256] [--mean-unmask 3.2] [--requests-per-batch 2]
//!                     [--alpha 1.5] [--focus-knee TOKENS] [--quantization fp8] [--fp8-error]
//!                     [--breakdown] [--phases] [--profile-step] [--repeats 1] [--json FILE] [--commit SHA] [--tiny] [--kernels POLICY]
//!
//! For each batch B: `requests-per-batch × B` requests queued at once, at most B decoding
//! together (first done, first out: a finished request's slot is refilled the next step).
//! Prompt lengths are ShareGPT-like (lognormal, median 128, σ 0.9, clipped to 8..512); every
//! request generates `new-tokens` tokens (eos ignored) in blocks of `block` with at most `block`
//! steps per block. Tokens revealed per step are replayed from a seeded distribution over
//! 1..=block, most confident first; its mean is calibrated so that the *realised* mean — a step
//! cannot reveal more than the masks left in its block — is `mean-unmask` (3.2 ≈ 10 % of a
//! 32-block, as FOCUS reports; `--no-calibrate` uses it as the distribution's mean instead). Modes: `baseline` recomputes the whole block every step; `baseline-delayed`
//! adds the delayed cache (only masked positions and those whose right neighbour was masked a
//! step ago are recomputed); `focus` adds FOCUS eviction (α = `--alpha`, default 1.5) on top of
//! the delayed cache, at the same replay — a like-for-like comparison; `--focus-knee N` makes its
//! budget load-aware (`Focus::with_knee`: launches of fewer than N tokens scale α by N / n).
//!
//! Reported per run: generated tokens/s over the steady-state window (steps with all B rows
//! busy), tokens/s over the whole run, tokens run through the network per request-step,
//! tokens decoded per request-step. `--breakdown` also times one full-batch step phase by phase
//! (device synchronised between phases): QKV projection with q/k norm, RoPE and the K/V write,
//! paged attention, output projection + MLP, LM head with greedy readout. `--phases` times the
//! engine's own denoise launches phase by phase (embedding, layers — for FOCUS layers 0–1 with
//! importance, selection, compaction, layers past 1 — and LM head + readout) by synchronising
//! the device at each boundary; those runs are slightly slower and are marked `phase_timed`.
//! `--repeats N` runs each (batch, mode) N times (a fresh engine each) and reports the median run
//! by window tokens/s, keeping every run's figure in the JSON.
//! `--model llada` runs LLaDA-8B shapes (bidirectional) with modes `exact` (the whole canvas —
//! prompt and every generated position — every step, as LLaDA's `generate` does), `prefix` and
//! `dual` (Fast-dLLM's caches): what exactness costs. Blocks of `--block` start at the prompt's
//! end; the unmask replay is the same in every mode.
//! `--model llada2-mini` runs LLaDA2.0-mini shapes (16 B parameters, 1.4 B active: a dense
//! first layer, 19 MoE layers of 256 experts, 8 per token, one shared expert; block-causal like
//! SDAR) with the same modes as SDAR.
//!
//! Every row also gets a compute bound (under `--quantization fp8` with a W8A8 policy, the
//! layers' matmuls at the FP8 linear peak measured at start, `device_peak::fp8_linear_peak`;
//! everything else at bf16's): the bf16 matmul peak measured at start (sustained on
//! random data, `device_peak::MatmulPeak`; the JSON also carries the burst on ones) divided by the
//! FLOPs per decoded token — 2 × the *active* layer parameters per position the mode runs
//! through the network, 2 × the LM head per readout, and attention (4 · heads · head_dim · layers
//! FLOPs per query and key, at the workload's mean context) — and the fraction of it reached.
//! FOCUS runs fewer positions past layer 1 than it scores; its bound counts every scored
//! position through every layer, which lowers the bound, so FOCUS's fraction of it is overstated
//! (compare FOCUS by tokens/s, not by that fraction).
//! `--quantization fp8` stores the model's linear layers in FP8 (E4M3, a scale per output
//! channel); `--fp8-error` only measures what that costs the logits: the FP8 and the dense
//! model on the same random weights, one row of a prompt and a masked block, relative error and
//! argmax agreement (block-causal models).
//! `--tiny` runs a tiny config on the CPU (a smoke test of this binary).

use candle_core::{DType, Device, Tensor};
use ponder::diffusion::models::{DenseDiffusion, DiffusionModel, Llada, Llada2, Sdar};
use ponder::diffusion::models::{Llada2Config, LladaConfig, SdarConfig};
use ponder::diffusion::{Replay, UnmaskTrace};
use ponder::engine::internals::greedy_readout;
use ponder::kv::KvStore;
use ponder::ops::{paged_attention, AttnMask, PagedBatch, PagedBatchHost};
use ponder::testing::{random_llada2_weights, random_llada_weights, random_sdar_weights, tiny_llada2_config, tiny_llada_config, tiny_sdar_config};
use ponder::{EngineBuilder, Event, GenerationParams};
use std::time::Instant;

struct Args {
    batches: Vec<usize>,
    modes: Vec<String>,
    block: usize,
    new_tokens: usize,
    mean_unmask: f64,
    alpha: f32,
    /// FOCUS's load-aware budget: launches of fewer tokens keep more (0: the published rule).
    focus_knee: usize,
    /// How the model's linear layers are stored (`--quantization fp8`).
    quantization: ponder::quant::Quantization,
    /// `--fp8-error`: only measure FP8's logit error against the dense model.
    fp8_error: bool,
    calibrate: bool,
    requests_per_batch: usize,
    breakdown: bool,
    phases: bool,
    /// Wrap one full-batch launch of each run, after ten, in `cuProfilerStart/Stop` (for `ncu
    /// --profile-from-start off`); that launch is left out of the window's figures.
    profile_step: bool,
    repeats: usize,
    json: Option<String>,
    commit: String,
    tiny: bool,
    model: String,
    /// Kernel choices of every engine and of the breakdown's ops (`--kernels`).
    kernels: ponder::kernels::KernelPolicy,
}

fn parse() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        batches: vec![32, 64, 128, 256],
        modes: vec!["baseline".into(), "baseline-delayed".into()],
        block: 32,
        new_tokens: 256,
        mean_unmask: 3.2,
        alpha: 1.5,
        focus_knee: 0,
        quantization: ponder::quant::Quantization::None,
        fp8_error: false,
        calibrate: true,
        requests_per_batch: 2,
        breakdown: false,
        phases: false,
        profile_step: false,
        repeats: 1,
        json: None,
        commit: "unknown".into(),
        tiny: false,
        model: "sdar".into(),
        kernels: ponder::kernels::KernelPolicy::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--batches" => a.batches = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--modes" => a.modes = v()?.split(',').map(String::from).collect(),
            "--block" => a.block = v()?.parse()?,
            "--new-tokens" => a.new_tokens = v()?.parse()?,
            "--mean-unmask" => a.mean_unmask = v()?.parse()?,
            "--alpha" => a.alpha = v()?.parse()?,
            "--focus-knee" => a.focus_knee = v()?.parse()?,
            "--quantization" => a.quantization = v()?.parse()?,
            "--fp8-error" => a.fp8_error = true,
            "--no-calibrate" => a.calibrate = false,
            "--requests-per-batch" => a.requests_per_batch = v()?.parse()?,
            "--breakdown" => a.breakdown = true,
            "--phases" => a.phases = true,
            "--profile-step" => a.profile_step = true,
            "--repeats" => a.repeats = v()?.parse::<usize>()?.max(1),
            "--json" => a.json = Some(v()?),
            "--commit" => a.commit = v()?,
            "--tiny" => a.tiny = true,
            "--model" => a.model = v()?,
            "--kernels" => a.kernels = v()?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let known: &[&str] = match a.model.as_str() {
        "sdar" => &["baseline", "baseline-delayed", "focus"],
        "llada" => &["exact", "prefix", "dual"],
        "llada2-mini" => &["baseline", "baseline-delayed", "focus"],
        other => return Err(format!("unknown model {other} (sdar | llada | llada2-mini)").into()),
    };
    if a.model == "llada" && a.modes == ["baseline", "baseline-delayed"] {
        a.modes = known.iter().map(|m| m.to_string()).collect();
    }
    for m in &a.modes {
        if !known.contains(&m.as_str()) {
            return Err(format!("unknown mode {m} for {} ({})", a.model, known.join(" | ")).into());
        }
    }
    Ok(a)
}

fn lognormal(median: f64, sigma: f64, lo: usize, hi: usize, x: &mut u64) -> usize {
    let mut u = || {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        ((*x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let z = (-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos();
    ((median * (sigma * z).exp()).round() as usize).clamp(lo, hi)
}

/// `n` prompts of ShareGPT-like lengths over the vocabulary minus the mask token.
fn prompts(n: usize, vocab: usize, mask: u32, seed: u64, max_len: usize) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            let len = lognormal(128.0, 0.9, 8, max_len, &mut x);
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let t = (x % (vocab as u64 - 1)) as u32;
                    if t >= mask {
                        t + 1
                    } else {
                        t
                    }
                })
                .collect()
        })
        .collect()
}

struct RunStats {
    window_tokens_per_s: f64,
    whole_tokens_per_s: f64,
    tokens_per_step: f64,
    /// Prompt-prefill and clean-K/V positions the launches ran besides the steps, per request-step.
    other_tokens_per_step: f64,
    /// Masked tokens per request-step (the readouts before eviction; FOCUS reads out only the
    /// kept ones).
    readouts_per_step: f64,
    decoded_per_step: f64,
    kept_per_step: Option<f64>,
    window_steps: usize,
    /// Wall ms per denoise launch: inside the runner (enqueue, device, readback) and the rest
    /// (scheduling, unmasking, events).
    launch_ms: f64,
    host_ms: f64,
    /// ms per launch by phase (`--phases`).
    phases: Vec<(&'static str, f64)>,
    /// Peak device memory of the run, engine build included (CUDA).
    peak: Option<ponder::bench::device_memory::PeakMemory>,
}

fn run(model: &DenseDiffusion, args: &Args, trace_mean: f64, batch: usize, mode: &str, jobs: &[Vec<u32>]) -> Result<RunStats, Box<dyn std::error::Error>> {
    let delayed = mode == "baseline-delayed" || mode == "focus";
    let spec = model.spec().clone();
    let max_len = jobs.iter().map(Vec::len).max().unwrap_or(1) + args.new_tokens + 2 * args.block;
    let trace = UnmaskTrace::with_mean(trace_mean, args.block, 2026)?;
    // Peak memory of this run: the previous run's engine is freed by now.
    model.device().synchronize()?;
    // Unmeasured rather than a failed run if the driver refuses the memory counters.
    let tracked = ponder::bench::device_memory::reset_peak(model.device()).inspect_err(|e| eprintln!("peak memory not measured: {e}")).is_ok();
    let mut builder = EngineBuilder::from_diffusion_model(Box::new(model.clone()), None, vec![]).kernels(args.kernels);
    if mode == "focus" {
        let focus = ponder::diffusion::Focus::new(args.alpha)?.with_knee(args.focus_knee);
        builder = builder.diffusion(|o| o.eviction_policy(focus));
    }
    let cache = match mode {
        "exact" => Some(ponder::diffusion::CanvasCache::Exact),
        "prefix" => Some(ponder::diffusion::CanvasCache::Prefix),
        "dual" => Some(ponder::diffusion::CanvasCache::Dual),
        _ => None,
    };
    if let Some(c) = cache {
        builder = builder.diffusion(|o| o.canvas_cache(c));
    }
    // A bidirectional step row is its whole canvas: budget every row's canvas at once.
    let budget = if cache.is_some() { batch * max_len + 8192 } else { batch * (args.block * 2 + 1) + 8192 };
    let mut engine = builder
        .diffusion(|o| o.block_length(args.block).max_steps_per_block(args.block).delayed_cache(delayed).unmask_policy(Replay::new(trace)))
        .max_num_seqs(batch)
        .max_num_batched_tokens(budget)
        .kv_capacity_tokens(batch * max_len)
        .max_model_len(spec.max_context.min(4096))
        .diffusion(|o| o.time_denoise_phases(args.phases))
        .build()?;
    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(args.new_tokens) };
    // Warm-up: one short request per row so kernels and allocations are in place.
    for p in jobs.iter().take(batch) {
        engine.add_request(p.clone(), GenerationParams { max_new_tokens: args.block, ..params.clone() })?;
    }
    while engine.has_work() {
        engine.step()?.iter().try_for_each(ponder::bench::fail_on_error)?;
    }
    let before = engine.metrics().clone();
    for p in jobs {
        engine.add_request(p.clone(), params.clone())?;
    }
    let device = engine_device(model);
    device.synchronize()?;
    let start = Instant::now();
    let (mut tokens, mut window_tokens, mut window_time, mut window_steps) = (0u64, 0u64, 0f64, 0usize);
    let mut profile_pending = args.profile_step;
    while engine.has_work() {
        let full = engine.requests().num_running() == batch;
        let profiled = profile_pending && full && window_steps == 10;
        profile_pending &= !profiled;
        if profiled {
            profiler_range(&device, true)?;
        }
        let t = Instant::now();
        let events = engine.step()?;
        let dt = t.elapsed().as_secs_f64();
        events.iter().try_for_each(ponder::bench::fail_on_error)?;
        if profiled {
            profiler_range(&device, false)?;
            println!("profiled one full-batch launch of batch {batch} ({mode}; cuProfilerStart/Stop)");
        }
        let n = events.iter().filter(|e| matches!(e, Event::Token { .. })).count() as u64;
        tokens += n;
        // The profiled launch ran under the profiler: not a steady-state figure.
        if full && !profiled && engine.requests().num_running() + engine.requests().num_waiting() > 0 {
            window_tokens += n;
            window_time += dt;
            window_steps += 1;
        }
    }
    let whole = start.elapsed().as_secs_f64();
    let m = engine.metrics();
    let stage = |m: &ponder::EngineMetrics| m.stages.get("denoise").map_or((0, 0.0), |s| (s.launches, s.time.as_secs_f64()));
    let ((l0, t0), (l1, t1)) = (stage(&before), stage(m));
    let launches = (l1 - l0).max(1) as f64;
    let (d, b0) = (m.denoise().expect("a diffusion engine"), before.denoise().expect("a diffusion engine"));
    let phase_before: std::collections::HashMap<_, _> = b0.phases.iter().cloned().collect();
    let phases = d.phases.iter().map(|(p, d)| (*p, (d.as_secs_f64() - phase_before.get(p).map_or(0.0, |b| b.as_secs_f64())) * 1e3 / launches)).collect();
    let steps = d.steps - b0.steps;
    let step_tokens = d.step_tokens - b0.step_tokens;
    let generated = m.generated_tokens - before.generated_tokens;
    Ok(RunStats {
        window_tokens_per_s: if window_time > 0.0 { window_tokens as f64 / window_time } else { tokens as f64 / whole },
        whole_tokens_per_s: tokens as f64 / whole,
        tokens_per_step: step_tokens as f64 / steps.max(1) as f64,
        other_tokens_per_step: (d.other_tokens - b0.other_tokens) as f64 / steps.max(1) as f64,
        readouts_per_step: (d.readouts - b0.readouts) as f64 / steps.max(1) as f64,
        decoded_per_step: generated as f64 / steps.max(1) as f64,
        kept_per_step: (mode == "focus").then(|| {
            let (k, n) = (d.kept_tokens - b0.kept_tokens, d.scored_steps - b0.scored_steps);
            k as f64 / n.max(1) as f64
        }),
        window_steps,
        launch_ms: (t1 - t0) * 1e3 / launches,
        host_ms: (whole - (t1 - t0)) * 1e3 / launches,
        phases,
        peak: if tracked { ponder::bench::device_memory::peak(model.device()).ok().flatten() } else { None },
    })
}

/// Starts (`on`) or stops the CUDA profiler's range after synchronising the device, so that
/// `ncu --profile-from-start off` sees exactly the launches in between. Nothing without CUDA.
fn profiler_range(device: &Device, on: bool) -> Result<(), Box<dyn std::error::Error>> {
    device.synchronize()?;
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::sys;
        // SAFETY: profiler range calls take no arguments and only mark the range.
        let status = unsafe {
            if on {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            }
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuProfiler{}: {status:?}", if on { "Start" } else { "Stop" }).into());
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = on;
    Ok(())
}

/// The replay distribution's mean: calibrated so that whole blocks realise `args.mean_unmask`
/// tokens per step (`UnmaskTrace::with_realised_mean`), or taken as given with `--no-calibrate`.
fn trace_mean(args: &Args) -> Result<f64, Box<dyn std::error::Error>> {
    if !args.calibrate {
        return Ok(args.mean_unmask);
    }
    Ok(UnmaskTrace::with_realised_mean(args.mean_unmask, args.block, 2026)?.expected_mean())
}

fn engine_device(model: &DenseDiffusion) -> Device {
    model.device().clone()
}

/// Times one full-batch step (every row a whole block after a `prompt`-token prefix) phase by
/// phase, synchronising the device between phases.
fn breakdown(model: &DenseDiffusion, batch: usize, block: usize, prompt: usize) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let s = model.spec().clone();
    let dev = model.device().clone();
    let page = 16;
    let ctx = prompt + block;
    let per_row = ctx.div_ceil(page);
    let kv = KvStore::new(s.num_layers, batch * per_row, page, s.num_kv_heads, s.head_dim, s.dtype, &dev)?;
    let mut host = PagedBatchHost { cu_q_lens: vec![0], ..Default::default() };
    for r in 0..batch {
        host.block_tables.push(((r * per_row) as u32..((r + 1) * per_row) as u32).collect());
        host.context_lens.push(ctx as u32);
        host.cu_q_lens.push(((r + 1) * block) as u32);
    }
    let positions: Vec<u32> = (0..batch).flat_map(|_| (prompt as u32)..(ctx as u32)).collect();
    let batch_desc = PagedBatch::new(host, page, AttnMask::BlockCausal(block), s.num_kv_heads * s.head_dim, &dev)?;
    let ids = Tensor::new(vec![s.mask_token_id; batch * block].as_slice(), &dev)?;
    let pos = Tensor::new(positions.as_slice(), &dev)?;
    let readout: Vec<u32> = (0..batch).flat_map(|r| (0..block - 3).map(move |j| (r * block + 3 + j) as u32)).collect();
    let readout = Tensor::new(readout.as_slice(), &dev)?;
    let scale = 1.0 / (s.head_dim as f64).sqrt();
    let mut bias = vec![0f32; s.vocab_size];
    bias[s.mask_token_id as usize] = f32::NEG_INFINITY;
    let no_mask_bias = Tensor::from_vec(bias, (1, s.vocab_size), &dev)?;
    let mut t = [0f64; 5]; // embed+rope, project+write, attention, o+mlp, head
    for rep in 0..3 {
        let mut phase = [0f64; 5];
        let mut clock = Instant::now();
        let mut lap = |i: usize, clock: &mut Instant| -> candle_core::Result<()> {
            dev.synchronize()?;
            phase[i] += clock.elapsed().as_secs_f64();
            *clock = Instant::now();
            Ok(())
        };
        let mut h = model.embed(&ids)?;
        let rope = model.rope(&pos)?;
        lap(0, &mut clock)?;
        for l in 0..s.num_layers {
            let p = model.project_write(l, &h, &rope, &batch_desc, &kv)?;
            lap(1, &mut clock)?;
            let a = paged_attention(&p.q, kv.k(l), kv.v(l), &batch_desc, scale)?;
            drop(a);
            lap(2, &mut clock)?;
            h = model.finish_layer(l, &h, &p.q, &batch_desc, &kv)?;
            lap(3, &mut clock)?;
        }
        let (tok, conf) = greedy_readout(model, &h.index_select(&readout, 0)?, &no_mask_bias)?;
        drop((tok, conf));
        lap(4, &mut clock)?;
        if rep > 0 {
            for i in 0..5 {
                t[i] += phase[i] / 2.0;
            }
        }
    }
    // finish_layer ran attention again: o_proj + MLP = finish − attention.
    let (embed, proj, attn, finish, head) = (t[0], t[1], t[2], t[3], t[4]);
    let o_mlp = (finish - attn).max(0.0);
    let total = embed + proj + attn + o_mlp + head;
    let ms = |x: f64| (x * 1e4).round() / 10.0;
    println!(
        "breakdown batch {batch} × {block} tokens (prefix {prompt}): total {:.1} ms = qkv+norm+rope+kv write {:.1} · attention {:.1} · o+mlp {:.1} · lm head+readout {:.1} · embed {:.1}",
        total * 1e3, proj * 1e3, attn * 1e3, o_mlp * 1e3, head * 1e3, embed * 1e3
    );
    Ok(serde_json::json!({
        "batch": batch, "tokens": batch * block, "prefix": prompt, "total_ms": ms(total),
        "qkv_norm_rope_kv_write_ms": ms(proj), "attention_ms": ms(attn), "o_proj_mlp_ms": ms(o_mlp),
        "lm_head_readout_ms": ms(head), "embed_rope_ms": ms(embed),
    }))
}

fn write_json(args: &Args, label: &str, results: &[serde_json::Value], breakdowns: &[serde_json::Value]) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "gpu": ponder::bench::gpu_name(), "commit": args.commit, "model": label,
            "command": std::env::args().collect::<Vec<_>>().join(" "), "kernels": format!("{:?}", args.kernels),
            "workload": "prompts lognormal(median 128, sigma 0.9) clipped 8..512; new tokens fixed; eos ignored; replayed unmask counts, most confident first",
            "focus": {"alpha": args.alpha, "knee_tokens": args.focus_knee}, "quantization": format!("{:?}", args.quantization),
            "results": results, "breakdown": breakdowns,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// The model `--model` names (`--tiny`: its tiny config on the CPU), random weights from seed 7
/// (the same on every call), its linear layers stored as `q` says.
fn load_model(
    args: &Args,
    q: ponder::quant::Quantization,
    device: &Device,
    dtype: DType,
) -> Result<(DenseDiffusion, &'static str), Box<dyn std::error::Error>> {
    let device = device.clone();
    Ok(match (args.model.as_str(), args.tiny) {
        ("llada", true) => (
            Llada::load(&tiny_llada_config(512), &random_llada_weights(&tiny_llada_config(512), 7, dtype, &device)?.with_quantization(q))?,
            "tiny LLaDA (CPU, f32)",
        ),
        ("llada", false) => (
            Llada::load(&LladaConfig::llada_8b(), &random_llada_weights(&LladaConfig::llada_8b(), 7, dtype, &device)?.with_quantization(q))?,
            "LLaDA-8B shapes, random bf16 weights",
        ),
        ("llada2-mini", true) => {
            let mut c = tiny_llada2_config(512);
            c.block_size = Some(8);
            (Llada2::load(&c, &random_llada2_weights(&c, 7, dtype, &device)?.with_quantization(q))?, "tiny LLaDA2.0 (CPU, f32)")
        }
        ("llada2-mini", false) => {
            let c = Llada2Config::llada2_mini();
            (Llada2::load(&c, &random_llada2_weights(&c, 7, dtype, &device)?.with_quantization(q))?, "LLaDA2.0-mini shapes, random bf16 weights")
        }
        (_, true) => {
            let mut c = tiny_sdar_config(512);
            c.block_size = Some(8);
            (Sdar::load(&c, &random_sdar_weights(&c, 7, dtype, &device)?.with_quantization(q))?, "tiny SDAR (CPU, f32)")
        }
        (_, false) => {
            let c = SdarConfig::sdar_8b_chat_b32();
            (Sdar::load(&c, &random_sdar_weights(&c, 7, dtype, &device)?.with_quantization(q))?, "SDAR-8B-Chat-b32 shapes, random bf16 weights")
        }
    })
}

/// `--fp8-error`: the logits of the FP8 model against the dense one on the same weights, over
/// one row of a 96-token prompt and a block of masks (block-causal, as a denoising step sees
/// it): the relative error ‖fp8 − dense‖ / ‖dense‖ and how many positions' argmax agree.
fn fp8_logit_error(args: &Args, device: &Device, dtype: DType) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    if args.model == "llada" {
        return Err("--fp8-error measures the block-causal models (sdar, llada2-mini)".into());
    }
    let (dense, label) = load_model(args, ponder::quant::Quantization::None, device, dtype)?;
    let (fp8, _) = load_model(args, ponder::quant::Quantization::Fp8, device, dtype)?;
    let s = dense.spec().clone();
    let (block, page) = (args.block, 16);
    let mut toks = ponder::bench::random_ids(96, s.vocab_size, 5);
    for t in toks.iter_mut().filter(|t| **t == s.mask_token_id) {
        *t = (*t + 1) % s.vocab_size as u32;
    }
    toks.extend(std::iter::repeat_n(s.mask_token_id, block));
    let n = toks.len();
    let logits = |model: &DenseDiffusion| -> Result<Tensor, Box<dyn std::error::Error>> {
        let kv = KvStore::new(s.num_layers, n.div_ceil(page), page, s.num_kv_heads, s.head_dim, s.dtype, device)?;
        let host = PagedBatchHost {
            cu_q_lens: vec![0, n as u32],
            block_tables: vec![(0..n.div_ceil(page) as u32).collect()],
            context_lens: vec![n as u32],
            write_positions: (0..n as u32).collect(),
        };
        let batch = PagedBatch::new(host, page, AttnMask::BlockCausal(block), s.num_kv_heads * s.head_dim, device)?;
        let h = model.embed(&Tensor::new(toks.as_slice(), device)?)?;
        let rope = model.rope(&Tensor::new((0..n as u32).collect::<Vec<_>>().as_slice(), device)?)?;
        Ok(model.head(&model.forward(&h, &rope, &batch, &kv)?)?.to_dtype(DType::F64)?.to_device(&Device::Cpu)?)
    };
    let (a, b) = (logits(&fp8)?, logits(&dense)?);
    let rel = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt() / b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let (am_a, am_b) = (a.argmax(1)?.to_vec1::<u32>()?, b.argmax(1)?.to_vec1::<u32>()?);
    let agree = am_a.iter().zip(&am_b).filter(|(x, y)| x == y).count();
    println!("{label}: FP8 logits against dense, relative error {rel:.3e}; argmax agrees at {agree} of {n} positions");
    Ok(serde_json::json!({"model": label, "positions": n, "logits_rel_err": rel, "argmax_agree": agree, "dtype": format!("{dtype:?}")}))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = parse()?;
    let (device, dtype) = if args.tiny { (Device::Cpu, DType::F32) } else { (Device::new_cuda(0)?, DType::BF16) };
    if args.tiny {
        args.block = 8;
        args.new_tokens = args.new_tokens.min(24);
        if args.batches == [32, 64, 128, 256] {
            args.batches = vec![2, 4];
        }
    }
    if args.fp8_error {
        // The models run outside an engine: the FP8 kernel policy is set around them.
        let report = ponder::ops::with_kernels(args.kernels, || fp8_logit_error(&args, &device, dtype)).0?;
        if let Some(path) = &args.json {
            let doc = serde_json::json!({"gpu": ponder::bench::gpu_name(), "commit": args.commit, "command": std::env::args().collect::<Vec<_>>().join(" "), "kernels": format!("{:?}", args.kernels), "fp8_error": report});
            std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        }
        return Ok(());
    }
    let t = Instant::now();
    let (model, label) = load_model(&args, args.quantization, &device, dtype)?;
    println!("device: {}; model: {label}", ponder::bench::gpu_name());
    device.synchronize()?;
    println!("random weights generated on the device in {:.1}s", t.elapsed().as_secs_f64());
    let spec = model.spec().clone();
    let measured = ponder::bench::device_peak::matmul_peak(&device)?;
    let peak = measured.sustained;
    println!("bf16 matmul peak {measured} (the sustained figure is the compute bound's ceiling)");
    // Under W8A8 the layers' matmuls run on the FP8 tensor cores: their FLOPs are bounded by the
    // FP8 linear peak, the rest (attention, the bf16 head) by bf16's. A mixture of experts runs
    // its routed experts dequantized (no FP8 grouped GEMM yet): its bound stays bf16's.
    let moe = matches!(args.model.as_str(), "llada2-mini");
    let fp8_peak = if args.quantization == ponder::quant::Quantization::Fp8 && args.kernels.fp8_quantizes_activations(32) && !moe {
        let p = ponder::bench::device_peak::fp8_linear_peak(&device)?;
        if let Some(p) = p {
            println!("FP8 W8A8 linear peak {:.0} TFLOP/s sustained (activation quantization included): the layers' ceiling", p / 1e12);
        }
        p
    } else {
        None
    };
    let mean = trace_mean(&args)?;
    println!("replayed unmask counts: distribution mean {mean:.3} for a realised {:.2} tokens per step", args.mean_unmask);
    let mut results = Vec::new();
    let mut breakdowns = Vec::new();
    println!("{:>6} {:>18} {:>11} {:>11} {:>13} {:>13} {:>7}", "batch", "mode", "tok/s", "whole tok/s", "tokens/step", "decoded/step", "steps");
    for &b in &args.batches {
        let jobs = prompts(args.requests_per_batch * b, spec.vocab_size, spec.mask_token_id, 42 + b as u64, 512.min(spec.max_context / 2));
        // Mean keys a query sees: its prompt, half the generation, half a block.
        let context = jobs.iter().map(Vec::len).sum::<usize>() as f64 / jobs.len().max(1) as f64 + args.new_tokens as f64 / 2.0 + args.block as f64 / 2.0;
        for mode in &args.modes {
            let mut runs = (0..args.repeats).map(|_| run(&model, &args, mean, b, mode, &jobs)).collect::<Result<Vec<_>, _>>()?;
            runs.sort_by(|x, y| x.window_tokens_per_s.total_cmp(&y.window_tokens_per_s));
            let all_tps: Vec<f64> = runs.iter().map(|r| r.window_tokens_per_s).collect();
            let st = runs.swap_remove(args.repeats / 2);
            let tps = |m: &str| results.iter().find(|r: &&serde_json::Value| r["batch"] == b && r["mode"] == m).and_then(|r| r["tokens_per_s"].as_f64());
            let speedup = (mode != "baseline").then(|| tps("baseline")).flatten().map(|x| st.window_tokens_per_s / x);
            let over_delayed = (mode == "focus").then(|| tps("baseline-delayed")).flatten().map(|x| st.window_tokens_per_s / x);
            let bound = compute_bound(&spec, &st, context, peak, fp8_peak);
            println!(
                "{b:>6} {mode:>18} {:>11.0} {:>11.0} {:>13.2} {:>13.2} {:>7}  launch {:.1} ms + host {:.2} ms{}{}{}, compute bound {:.0} tok/s ({:.1} % of it; + {:.2} prefill/clean positions per step)",
                st.window_tokens_per_s,
                st.whole_tokens_per_s,
                st.tokens_per_step,
                st.decoded_per_step,
                st.window_steps,
                st.launch_ms,
                st.host_ms,
                speedup.map_or(String::new(), |x| format!(", {x:.2}x over baseline")),
                st.kept_per_step.map_or(String::new(), |k| format!(", kept/step {k:.2}")),
                over_delayed.map_or(String::new(), |x| format!(", {x:.2}x over delayed")),
                bound,
                100.0 * st.window_tokens_per_s / bound,
                st.other_tokens_per_step
            );
            if let Some(p) = st.peak {
                println!("{:>25} peak device memory {p}", "");
            }
            if !st.phases.is_empty() {
                let list: Vec<String> = st.phases.iter().map(|(p, ms)| format!("{p} {ms:.2}")).collect();
                println!("{:>25} ms per launch: {}", "", list.join(" · "));
            }
            let phases: serde_json::Map<String, serde_json::Value> = st.phases.iter().map(|(p, ms)| (p.to_string(), serde_json::json!(ms))).collect();
            results.push(serde_json::json!({
                "mode": mode, "batch": b, "tokens_per_s": st.window_tokens_per_s, "tokens_per_s_whole_run": st.whole_tokens_per_s,
                "speedup_vs_baseline": speedup, "speedup_vs_delayed": over_delayed, "kept_per_step": st.kept_per_step,
                "launch_ms": st.launch_ms, "host_ms_per_launch": st.host_ms, "repeats_tokens_per_s": all_tps, "phase_timed": args.phases, "phases_ms_per_launch": phases,
                "tokens_per_step": st.tokens_per_step, "other_tokens_per_step": st.other_tokens_per_step, "readouts_per_step": st.readouts_per_step, "decoded_per_step": st.decoded_per_step, "window_steps": st.window_steps,
                "requests": jobs.len(), "new_tokens": args.new_tokens, "block": args.block, "mean_unmask": args.mean_unmask,
                "mean_context": context, "compute_bound_tokens_per_s": bound, "fraction_of_compute_bound": st.window_tokens_per_s / bound,
            }));
            let row = results.last_mut().and_then(|r| r.as_object_mut()).expect("just pushed");
            row.extend(ponder::bench::device_memory::PeakMemory::json_fields(st.peak).map(|(k, v)| (k.to_string(), v.into())));
            row.extend(measured.json_fields().map(|(k, v)| (k.to_string(), v.into())));
            row.insert("fp8_linear_peak_tflops".into(), fp8_peak.map(|p| p / 1e12).into());
        }
        if args.breakdown {
            breakdowns.push(ponder::ops::with_kernels(args.kernels, || breakdown(&model, b, args.block, 256)).0?);
        }
        // Written after every batch so a run cut short keeps what it measured.
        write_json(&args, label, &results, &breakdowns)?;
    }
    Ok(())
}

/// Decoded tokens per second if every FLOP ran at its peak: per request-step, 2 × the active
/// layer parameters per position run — the step's and the prompt-prefill and clean-K/V positions
/// the same launches ran — at `layer_peak` (the FP8 linear peak under W8A8, else `peak`), and at
/// `peak` attention at `context` keys per query (QKᵀ and PV: 4 · heads · head_dim per layer; the
/// mean context for every position, prefill included: an approximation) and 2 × the LM head per
/// readout.
fn compute_bound(spec: &ponder::diffusion::models::DiffusionSpec, st: &RunStats, context: f64, peak: f64, layer_peak: Option<f64>) -> f64 {
    let attention = 4.0 * (spec.num_heads * spec.head_dim * spec.num_layers) as f64 * context;
    let positions = st.tokens_per_step + st.other_tokens_per_step;
    let layers = positions * 2.0 * spec.layer_params as f64;
    let rest = positions * attention + st.readouts_per_step * 2.0 * spec.head_params as f64;
    let seconds = layers / layer_peak.unwrap_or(peak) + rest / peak;
    st.decoded_per_step / seconds.max(f64::MIN_POSITIVE)
}
