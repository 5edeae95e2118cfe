//! Latency against request rate under live load (`benchmark_serving`'s conventions): open-loop
//! Poisson arrivals from a fixed seed (or a burst), ShareGPT- or Alpaca-like lengths, a warm-up
//! and a measurement window per rate; the same trace through the in-process `EngineHandle` or,
//! with `--url`, through a running server's OpenAI API.
//!
//!     cargo run --release -p ponder-serve --example bench_serving -- --rates 2,8 --duration 10
//!     cargo run --release -p ponder-serve --example bench_serving -- --ouro-1.4b --cuda --width 64 \
//!         --scheduler cdb-refill --mean-depth 2.5 --workload sharegpt --rates 2,4,6,8 --json out.json
//!     cargo run --release -p ponder-serve --example bench_serving -- --url http://127.0.0.1:8000 \
//!         --served-model tiny-ouro --rates 1,2
//!
//! In process: `--model DIR` (default `assets/tiny-ouro`) or `--ouro-1.4b` (random bf16 weights
//! in the released shapes, generated on the device), `--cuda`, `--width W` (max_num_seqs),
//! `--scheduler cb|cdb-refill|cdb-no-refill` with exit depths replayed from a seeded
//! distribution (`--mean-depth`, `--min-depth`), `--layout` (depth batching: `last-exited` by
//! default). Per rate it prints and records completed
//! requests/s, output tokens/s, time to first token, time per output token, inter-token and
//! end-to-end latency, normalized latency (end-to-end ÷ output tokens) and goodput under
//! `--slo-ttft-ms` / `--slo-tpot-ms`. `--requests N`: the pool of distinct requests a trace
//! cycles through (default 4096); a burst sends all of them at once — its completed
//! requests/s is the mode's drain rate, the knee.

use ponder::bench::{workload, Lengths};
use ponder::{DType, Device, EngineBuilder, KvLayoutKind, SchedulerKind};
use ponder_serve::load::{self, Slo, Summary};
use std::time::Duration;

struct Args {
    url: Option<String>,
    served_model: String,
    model: String,
    ouro_1_4b: bool,
    cuda: bool,
    width: usize,
    scheduler: String,
    layout: Option<String>,
    mean_depth: f64,
    min_depth: usize,
    workload: String,
    requests: usize,
    rates: Vec<Option<f64>>,
    warmup: f64,
    duration: f64,
    limit: f64,
    seed: u64,
    slo: Slo,
    label: Option<String>,
    json: Option<String>,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        url: None,
        served_model: "bench".into(),
        model: "assets/tiny-ouro".into(),
        ouro_1_4b: false,
        cuda: false,
        width: 64,
        scheduler: "cb".into(),
        layout: None,
        mean_depth: 2.5,
        min_depth: 1,
        workload: "sharegpt".into(),
        requests: 4096,
        rates: vec![Some(1.0), Some(2.0)],
        warmup: 5.0,
        duration: 30.0,
        limit: 120.0,
        seed: 0,
        slo: Slo { ttft_ms: 2000.0, tpot_ms: 100.0 },
        label: None,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--url" => a.url = Some(v()?.trim_end_matches('/').to_string()),
            "--served-model" => a.served_model = v()?,
            "--model" => a.model = v()?,
            "--ouro-1.4b" => a.ouro_1_4b = true,
            "--cuda" => a.cuda = true,
            "--width" => a.width = v()?.parse()?,
            "--scheduler" => a.scheduler = v()?,
            "--layout" => a.layout = Some(v()?),
            "--mean-depth" => a.mean_depth = v()?.parse()?,
            "--min-depth" => a.min_depth = v()?.parse()?,
            "--workload" => a.workload = v()?,
            "--requests" => a.requests = v()?.parse()?,
            "--rates" => a.rates = v()?.split(',').map(|r| if r == "burst" { Ok(None) } else { r.parse().map(Some) }).collect::<Result<_, _>>()?,
            "--warmup" => a.warmup = v()?.parse()?,
            "--duration" => a.duration = v()?.parse()?,
            "--limit" => a.limit = v()?.parse()?,
            "--seed" => a.seed = v()?.parse()?,
            "--slo-ttft-ms" => a.slo.ttft_ms = v()?.parse()?,
            "--slo-tpot-ms" => a.slo.tpot_ms = v()?.parse()?,
            "--label" => a.label = Some(v()?),
            "--json" => a.json = Some(v()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

/// The engine for the in-process runs: the model, its width, the scheduler and replayed depths.
fn engine(a: &Args) -> Result<(ponder::EngineHandle, String, usize, usize), Box<dyn std::error::Error>> {
    let device = if a.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let sched: SchedulerKind = match a.scheduler.as_str() {
        "cb" => SchedulerKind::Continuous,
        "cdb-refill" => SchedulerKind::Depth { refill: true },
        "cdb-no-refill" => SchedulerKind::Depth { refill: false },
        other => return Err(format!("--scheduler {other}: cb | cdb-refill | cdb-no-refill").into()),
    };
    // Vocabulary, context and loop depth, for the workload and the replayed exits.
    let (vocab, context, max_steps) = if a.ouro_1_4b {
        let c = ponder::looped::models::OuroConfig::ouro_1_4b();
        (c.vocab_size, c.max_position_embeddings, Some(c.total_ut_steps))
    } else {
        let probe = EngineBuilder::new(&a.model).build()?;
        let spec = probe.spec();
        let context = spec.looped().map(|s| s.max_context).or(spec.diffusion().map(|s| s.max_context)).unwrap_or(2048);
        (probe.vocab_size(), context, spec.looped().map(|s| s.max_steps))
    };
    let gate = match (sched, max_steps) {
        (SchedulerKind::Continuous, _) => None,
        (_, Some(max)) => {
            let trace = ponder::looped::gate::DepthTrace::with_mean(a.mean_depth, a.min_depth, max, 5)?;
            Some(ponder::looped::gate::Replay::new(trace, a.min_depth, max)?)
        }
        (_, None) => return Err("depth batching needs a looped model".into()),
    };
    // Early exits need a layout every token can read after any depth: last-exited by default.
    let layout: Option<KvLayoutKind> = match (&a.layout, &gate) {
        (Some(l), _) => Some(l.parse()?),
        (None, Some(_)) => Some(KvLayoutKind::LastExited),
        (None, None) => None,
    };
    // The builder's type differs by source (in-memory model or checkpoint); the rest is shared.
    macro_rules! spawn {
        ($b:expr) => {{
            let b = $b.max_num_seqs(a.width).max_num_batched_tokens(8192);
            let b = match &layout {
                Some(l) => b.looped(|o| o.kv_layout(*l)),
                None => b,
            };
            match gate {
                Some(g) => b.looped(|o| o.scheduler(sched).exit_gate(g)),
                None => b,
            }
            .spawn()?
        }};
    }
    let (handle, name) = if a.ouro_1_4b {
        let cfg = ponder::looped::models::OuroConfig::ouro_1_4b();
        let weights = ponder::testing::random_ouro_weights(&cfg, 7, DType::BF16, &device)?;
        let model = ponder::looped::models::Ouro::load(&cfg, &weights)?;
        (spawn!(EngineBuilder::from_model(Box::new(model), None, vec![])), "Ouro-1.4B shapes, random bf16 weights".to_string())
    } else {
        let b = EngineBuilder::new(&a.model).device(device);
        (spawn!(if a.cuda { b.dtype(DType::BF16) } else { b }), a.model.clone())
    };
    Ok((handle, name, vocab, context))
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
    let (warmup, duration, limit) = (Duration::from_secs_f64(a.warmup), Duration::from_secs_f64(a.duration), Duration::from_secs_f64(a.limit));
    let in_process = if a.url.is_none() { Some(engine(&a)?) } else { None };
    let (vocab, context) = in_process.as_ref().map_or((32_000, 4096), |e| (e.2, e.3));
    let jobs: Vec<(Vec<u32>, usize)> = workload(a.requests, vocab, context, a.seed + 1, lengths).into_iter().map(|j| (j.prompt, j.new_tokens)).collect();
    let target = match (&a.url, &in_process) {
        (Some(url), _) => format!("{url} ({})", a.served_model),
        (None, Some(e)) => format!("{}, in process, {} W {}", e.1, a.scheduler, a.width),
        _ => unreachable!(),
    };
    println!("{target}; {} lengths, seed {}, warm-up {:.0} s, window {:.0} s", a.workload, a.seed, a.warmup, a.duration);
    println!(
        "{:>7} {:>11} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "rate", "done/sent", "req/s", "tok/s", "TTFT p50", "p99", "TPOT p50", "p99", "ITL p99", "e2e p50", "p99", "norm", "norm p99", "goodput"
    );
    let client = reqwest::Client::new();
    let mut runs = Vec::new();
    for &rate in &a.rates {
        let arrivals = load::trace(&jobs, rate, warmup, duration, a.seed);
        // In process, the engine's own account of the run (preemptions, launches and their
        // wall time per stage) says where the time went.
        let before = in_process.as_ref().and_then(|e| e.0.metrics().ok());
        let records = match (&a.url, &in_process) {
            (Some(url), _) => load::http(&client, url, &a.served_model, &arrivals, limit).await,
            (None, Some((engine, ..))) => {
                let arrivals = arrivals.clone();
                // The handle lives for the whole run; borrow it on a blocking thread.
                tokio::task::block_in_place(|| load::in_process(engine, &arrivals, limit))
            }
            _ => unreachable!(),
        };
        let window = if rate.is_some() { (warmup, warmup + duration) } else { (Duration::ZERO, Duration::MAX) };
        let s = load::summarize(&records, window, a.slo);
        row(rate, &s);
        let engine = match (before, in_process.as_ref().and_then(|e| e.0.metrics().ok())) {
            (Some(b), Some(m)) => {
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
            _ => serde_json::Value::Null,
        };
        if !engine.is_null() {
            println!("        engine: {engine}");
        }
        runs.push(serde_json::json!({"rate": rate, "sent": records.len(), "summary": s, "engine": engine}));
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "target": target, "label": a.label, "scheduler": a.scheduler, "layout": a.layout, "width": a.width, "mean_depth": a.mean_depth, "min_depth": a.min_depth,
            "workload": a.workload, "lengths": lengths.json(), "seed": a.seed, "warmup_s": a.warmup, "duration_s": a.duration,
            "device": if a.cuda { "cuda:0" } else { "cpu" }, "command": std::env::args().collect::<Vec<_>>().join(" "), "runs": runs,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        println!("wrote {path}");
    }
    Ok(())
}
