//! Latency against request rate under live load (`benchmark_serving`'s conventions): open-loop
//! Poisson arrivals from a fixed seed (or a burst), ShareGPT- or Alpaca-like lengths, a warm-up
//! and a measurement window per rate; the same trace through the in-process `EngineHandle` or,
//! with `--url`, through a running server's OpenAI API.
//!
//!     cargo run --release -p ponder-serve --example bench_serving -- --rates 2,8 --duration 10
//!     cargo run --release -p ponder-serve --example bench_serving -- --shapes ouro-1.4b --cuda --width 64 \
//!         --mode cdb-refill --workload sharegpt --rates burst,6,12,18,24,30 --json out.json
//!     cargo run --release -p ponder-serve --example bench_serving -- --shapes sdar-8b --cuda --width 64 \
//!         --mode focus --rates burst,1,2,3 --json out.json
//!     cargo run --release -p ponder-serve --example bench_serving -- --url http://127.0.0.1:8000 \
//!         --served-model tiny-ouro --rates 1,2
//!
//! In process: `--model DIR` (default `assets/tiny-ouro`) or `--shapes ouro-1.4b | huginn-3.5b |
//! sdar-8b | llada2-mini` (random bf16 weights in the released shapes, generated on the device),
//! `--cuda`, `--width W` (max_num_seqs) and `--mode`:
//! - looped: `cb` (full-depth continuous batching), `cdb-refill`, `cdb-no-refill`, with exit
//!   depths replayed from a seeded distribution (`--mean-depth`, `--min-depth`; Ouro 2.5 over
//!   1..=4, Huginn 8 over 2..=16 by default) or a recording (`--depth-trace FILE`, from
//!   `quality_gates --traces`), `--layout` (last-exited by default), `--overlap on|off` (on by
//!   default), Huginn's coda held for `--min-coda` exited tokens (W by default, W − 1 requests
//!   parked beyond W);
//! - diffusion: `baseline`, `baseline-delayed` (the delayed cache), `focus` (delayed cache and
//!   FOCUS at `--alpha`, 1.5; `--focus-knee N`: launches of fewer than N tokens keep more),
//!   blocks of `--block` (32), unmask counts replayed at a realised
//!   `--mean-unmask` tokens per step (3.2, about 10 % of a 32-block as FOCUS reports).
//!
//! `--quantization fp8` stores the linear layers in FP8 (either source).
//!
//! Before the first rate, `--engine-warmup N` requests (default W, outputs capped at 64 tokens)
//! run at once and are not measured: a fresh process compiles kernels and captures graphs on
//! first use, which would otherwise land in the first rate's figures. Per rate: `--warmup`
//! seconds of arrivals, then a measurement window of `--duration` seconds, lengthened so that
//! at least `--min-completed` requests (200) are expected to arrive in it. Per rate it prints
//! and records completed requests/s, output tokens/s, time to first token, time per output
//! token, inter-token and end-to-end latency, normalized latency (end-to-end ÷ output tokens)
//! and goodput under `--slo-ttft-ms` / `--slo-tpot-ms`, and in process the engine's account
//! (preemptions; launches, tokens and wall time per stage). `--requests N`: the pool of distinct
//! requests a trace cycles through (default 4096); a burst sends all of them at once — its
//! completed requests/s is the mode's drain rate, the knee.

mod engine;

use ponder::bench::{workload, Lengths};
use ponder_serve::load::{self, Arrival, Record, Slo, Summary};
use std::time::{Duration, Instant};

struct Args {
    url: Option<String>,
    served_model: String,
    setup: engine::Setup,
    workload: String,
    requests: usize,
    rates: Vec<Option<f64>>,
    engine_warmup: Option<usize>,
    warmup: f64,
    duration: f64,
    min_completed: usize,
    limit: f64,
    seed: u64,
    slo: Slo,
    label: Option<String>,
    commit: Option<String>,
    json: Option<String>,
}

fn on_off(v: &str) -> Result<bool, String> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("{other}: on | off")),
    }
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        url: None,
        served_model: "bench".into(),
        setup: engine::Setup {
            shapes: None,
            model: "assets/tiny-ouro".into(),
            cuda: false,
            width: 64,
            mode: "cb".into(),
            layout: None,
            mean_depth: None,
            min_depth: None,
            depth_trace: None,
            overlap: None,
            min_coda: None,
            block: 32,
            mean_unmask: 3.2,
            alpha: 1.5,
            focus_knee: 0,
            quantization: ponder::quant::Quantization::None,
        },
        workload: "sharegpt".into(),
        requests: 4096,
        rates: vec![Some(1.0), Some(2.0)],
        engine_warmup: None,
        warmup: 5.0,
        duration: 30.0,
        min_completed: 200,
        limit: 120.0,
        seed: 0,
        slo: Slo { ttft_ms: 2000.0, tpot_ms: 100.0 },
        label: None,
        commit: None,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        let s = &mut a.setup;
        match k.as_str() {
            "--url" => a.url = Some(v()?.trim_end_matches('/').to_string()),
            "--served-model" => a.served_model = v()?,
            "--model" => s.model = v()?,
            "--shapes" => s.shapes = Some(v()?),
            "--ouro-1.4b" => s.shapes = Some("ouro-1.4b".into()),
            "--cuda" => s.cuda = true,
            "--width" => s.width = v()?.parse()?,
            "--mode" | "--scheduler" => s.mode = v()?,
            "--layout" => s.layout = Some(v()?),
            "--mean-depth" => s.mean_depth = Some(v()?.parse()?),
            "--min-depth" => s.min_depth = Some(v()?.parse()?),
            "--depth-trace" => s.depth_trace = Some(v()?),
            "--overlap" => s.overlap = Some(on_off(&v()?)?),
            "--min-coda" => s.min_coda = Some(v()?.parse()?),
            "--block" => s.block = v()?.parse()?,
            "--mean-unmask" => s.mean_unmask = v()?.parse()?,
            "--alpha" => s.alpha = v()?.parse()?,
            "--focus-knee" => s.focus_knee = v()?.parse()?,
            "--quantization" => s.quantization = v()?.parse()?,
            "--workload" => a.workload = v()?,
            "--requests" => a.requests = v()?.parse()?,
            "--rates" => a.rates = v()?.split(',').map(|r| if r == "burst" { Ok(None) } else { r.parse().map(Some) }).collect::<Result<_, _>>()?,
            "--engine-warmup" => a.engine_warmup = Some(v()?.parse()?),
            "--warmup" => a.warmup = v()?.parse()?,
            "--duration" => a.duration = v()?.parse()?,
            "--min-completed" => a.min_completed = v()?.parse()?,
            "--limit" => a.limit = v()?.parse()?,
            "--seed" => a.seed = v()?.parse()?,
            "--slo-ttft-ms" => a.slo.ttft_ms = v()?.parse()?,
            "--slo-tpot-ms" => a.slo.tpot_ms = v()?.parse()?,
            "--label" => a.label = Some(v()?),
            "--commit" => a.commit = Some(v()?),
            "--json" => a.json = Some(v()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if let Some(r) = a.rates.iter().flatten().find(|r| !(r.is_finite() && **r > 0.0)) {
        return Err(format!("--rates: {r} is not a positive request rate").into());
    }
    Ok(a)
}

/// The measurement window for `rate`: `duration` seconds, longer where fewer than
/// `min_completed` requests (plus three standard deviations of a Poisson count) would arrive.
fn window_for(rate: f64, duration: f64, min_completed: usize) -> f64 {
    let n = min_completed as f64;
    duration.max((n + 3.0 * n.sqrt()) / rate)
}

/// The same arrivals through whichever target the run drives.
async fn drive(client: &reqwest::Client, a: &Args, engine: Option<&engine::InProcess>, arrivals: &[Arrival], limit: Duration) -> Vec<Record> {
    match (&a.url, engine) {
        (Some(url), _) => load::http(client, url, &a.served_model, arrivals, limit).await,
        (None, Some(e)) => tokio::task::block_in_place(|| load::in_process(&e.handle, arrivals, limit)),
        (None, None) => unreachable!("an in-process run has an engine"),
    }
}

fn gpu_name() -> Option<String> {
    let out = std::process::Command::new("nvidia-smi").args(["--query-gpu=name", "--format=csv,noheader"]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).lines().next().map(|l| l.trim().to_string()).filter(|s| !s.is_empty())
}

fn row(rate: Option<f64>, s: &Summary) {
    let r = rate.map_or("burst".into(), |r| format!("{r:.2}"));
    println!(
        "{r:>7} {:>5}/{:<5} {:>8.2} {:>9.0} {:>8.0} {:>8.0} {:>8.1} {:>8.1} {:>8.1} {:>9.0} {:>9.0} {:>8.1} {:>8.1} {:>8.2}",
        s.completed,
        s.requests,
        s.request_throughput,
        s.output_throughput,
        s.ttft_ms.p50,
        s.ttft_ms.p99,
        s.tpot_ms.p50,
        s.tpot_ms.p99,
        s.itl_ms.p99,
        s.e2e_ms.p50,
        s.e2e_ms.p99,
        s.normalized_ms.mean,
        s.normalized_ms.p99,
        s.goodput
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let lengths = match a.workload.as_str() {
        "sharegpt" => Lengths::sharegpt(),
        "alpaca" => Lengths::alpaca(),
        other => return Err(format!("--workload {other}: sharegpt | alpaca").into()),
    };
    let limit = Duration::from_secs_f64(a.limit);
    let in_process = if a.url.is_none() { Some(engine::build(&a.setup)?) } else { None };
    let (vocab, context) = in_process.as_ref().map_or((32_000, 4096), |e| (e.handle.model().vocab_size, e.handle.model().max_context));
    let mask = in_process.as_ref().and_then(|e| e.mask_token);
    let jobs: Vec<(Vec<u32>, usize)> = workload(a.requests, vocab, context, a.seed + 1, lengths)
        .into_iter()
        // A diffusion prompt may not hold the mask token: its neighbour id does the same work.
        .map(|j| (j.prompt.into_iter().map(|t| if Some(t) == mask { (t + 1) % vocab as u32 } else { t }).collect(), j.new_tokens))
        .collect();
    let target = match (&a.url, &in_process) {
        (Some(url), _) => format!("{url} ({})", a.served_model),
        (None, Some(e)) => format!("{}, in process, {} W {}", e.name, a.setup.mode, a.setup.width),
        _ => unreachable!(),
    };
    println!("{target}; {} lengths, seed {}, warm-up {:.0} s, window ≥ {:.0} s and ≥ {} requests", a.workload, a.seed, a.warmup, a.duration, a.min_completed);
    let client = reqwest::Client::new();

    // Kernels compile and graphs are captured on first use: not in any rate's figures.
    let warm_n = a.engine_warmup.unwrap_or(a.setup.width).min(jobs.len());
    let warm_s = if warm_n > 0 {
        let warm_jobs: Vec<(Vec<u32>, usize)> = jobs.iter().take(warm_n).map(|(p, n)| (p.clone(), (*n).min(64))).collect();
        let t = Instant::now();
        let records = drive(&client, &a, in_process.as_ref(), &load::trace(&warm_jobs, None, Duration::ZERO, Duration::ZERO, a.seed), limit).await;
        if let Some(r) = records.iter().find(|r| !r.completed()) {
            return Err(format!("the engine warm-up failed: {r:?}").into());
        }
        let s = t.elapsed().as_secs_f64();
        println!("engine warm-up: {warm_n} requests at once in {s:.1} s (not measured)");
        s
    } else {
        0.0
    };
    println!(
        "{:>7} {:>11} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "rate", "done/sent", "req/s", "tok/s", "TTFT p50", "p99", "TPOT p50", "p99", "ITL p99", "e2e p50", "p99", "norm", "norm p99", "goodput"
    );
    // The JSON is rewritten after every rate, so a run cut short keeps the rates it finished.
    let gpu = if a.setup.cuda { gpu_name() } else { None };
    let write = |runs: &[serde_json::Value]| -> Result<(), Box<dyn std::error::Error>> {
        let Some(path) = &a.json else { return Ok(()) };
        let doc = serde_json::json!({
            "gpu": gpu, "commit": a.commit, "target": target, "label": a.label,
            "mode": a.setup.mode, "width": a.setup.width, "settings": in_process.as_ref().map(|e| e.settings.clone()), "quantization": format!("{:?}", a.setup.quantization),
            "workload": a.workload, "lengths": lengths.json(), "seed": a.seed, "warmup_s": a.warmup, "duration_s": a.duration,
            "min_completed": a.min_completed, "engine_warmup": {"requests": warm_n, "seconds": warm_s},
            "device": if a.setup.cuda { "cuda:0" } else { "cpu" }, "command": std::env::args().collect::<Vec<_>>().join(" "), "runs": runs,
        });
        Ok(std::fs::write(path, serde_json::to_string_pretty(&doc)?)?)
    };
    let mut runs = Vec::new();
    for &rate in &a.rates {
        let (warmup, window) = match rate {
            Some(r) => (Duration::from_secs_f64(a.warmup), Duration::from_secs_f64(window_for(r, a.duration, a.min_completed))),
            None => (Duration::ZERO, Duration::ZERO),
        };
        let arrivals = load::trace(&jobs, rate, warmup, window, a.seed);
        // In process, the engine's own account of the run (preemptions, launches and their
        // wall time per stage) says where the time went.
        let before = in_process.as_ref().and_then(|e| e.handle.metrics().ok());
        let records = drive(&client, &a, in_process.as_ref(), &arrivals, limit).await;
        let measured = if rate.is_some() { (warmup, warmup + window) } else { (Duration::ZERO, Duration::MAX) };
        let s = load::summarize(&records, measured, a.slo);
        row(rate, &s);
        let engine = match (before, in_process.as_ref().and_then(|e| e.handle.metrics().ok())) {
            (Some(b), Some(m)) => engine_account(&b, &m),
            _ => serde_json::Value::Null,
        };
        if !engine.is_null() {
            println!("        engine: {engine}");
        }
        runs.push(serde_json::json!({"rate": rate, "sent": records.len(), "window_s": window.as_secs_f64(), "summary": s, "engine": engine}));
        write(&runs)?;
    }
    if let Some(path) = &a.json {
        println!("wrote {path}");
    }
    Ok(())
}

/// What the engine did between two snapshots of its metrics: preemptions, and per stage the
/// launches, tokens and wall seconds.
fn engine_account(b: &ponder::EngineMetrics, m: &ponder::EngineMetrics) -> serde_json::Value {
    let stages: serde_json::Map<String, serde_json::Value> = m
        .stages
        .iter()
        .map(|(name, st)| {
            let was = b.stages.get(name);
            let launches = st.launches - was.map_or(0, |w| w.launches);
            let tokens = st.tokens - was.map_or(0, |w| w.tokens);
            let secs = (st.time - was.map_or(Duration::ZERO, |w| w.time)).as_secs_f64();
            (name.to_string(), serde_json::json!({"launches": launches, "tokens": tokens, "seconds": secs}))
        })
        .collect();
    serde_json::json!({"preemptions": m.preemptions - b.preemptions, "stages": stages})
}
