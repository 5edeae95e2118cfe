//! Trained exit gates on the shipped tiny Ouro: held-out perplexity, realised mean depth and
//! per-token agreement with the synchronous stock gate, by threshold q, for
//!
//! - (a) the stock gate, synchronous (Q-exit, minimum depth 2 — the teacher the heads learn),
//! - (b) the stock gate delayed one step (`Lookahead(QExit)`, what overlap needed before),
//! - (c) the learned lookahead (`LearnedLookahead`, the trained head; overlap on),
//! - (d) the preloop gate (`Preloop`, minimum depth 2; overlap on),
//! - (e) fixed depths 1..T,
//!
//! all on the last-exited KV layout (exact under exits), by teacher forcing through the engine
//! (continuous depth batching with refill, CPU, f32), on the same held-out windows as the
//! `quality` example.
//!
//!     cargo run --release --example quality_gates -- [--model assets/tiny-ouro]
//!         [--gates DIR (default: the model directory)] [--heldout corpus/heldout.txt]
//!         [--sequences 32] [--width 8] [--write docs/QUALITY.md]
//!         [--json docs/bench/quality_gates_tiny_ouro.json] [--traces DIR --trace-q 0.2,0.4]
//!
//! The heads are `lookahead_exit_gate.safetensors` and `preloop_exit_gate.safetensors` in
//! `--gates` (written by `tools/train/train_gate.py`). Agreement: the share of scored tokens
//! (after the first, which the prefill runs at full depth) whose loop depth equals (a)'s.
//!
//! `--traces DIR` writes, for each q in `--trace-q`, the per-token depths each gated
//! configuration chose, as `DIR/q{q}/{stock-sync,delayed,learned,preloop}.json` in the format of
//! `gate::DepthTrace::from_json_file` (list index = token index; index 0 is the prefill's), for
//! `bench_looped --suite cdb --depth-traces` to replay on real shapes.
//!
//! `--write FILE` replaces the part of FILE between `<!-- quality:gates:begin -->` and
//! `<!-- quality:gates:end -->`.

use ponder::looped::gate::{ExitGate, FixedDepth, LearnedLookahead, Lookahead, Preloop, QExit};
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind, SchedulerKind};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

#[path = "shared/report.rs"]
mod report;
use report::{shown, splice};
#[path = "shared/heldout.rs"]
mod heldout;
use heldout::{evenly_spaced_windows, read_heldout};

const PROMPT: usize = 32;
const SCORED: usize = 96;
const QS: [f32; 10] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
const BEGIN: &str = "<!-- quality:gates:begin -->";
const END: &str = "<!-- quality:gates:end -->";

/// One gated configuration: its label, file stem for traces, whether launches overlap, and how
/// to build its gate for a q (or a fixed depth).
struct Config {
    label: &'static str,
    stem: &'static str,
    overlap: bool,
    make: Box<dyn Fn(f32) -> ponder::Result<Box<dyn ExitGate>>>,
    params: Vec<f32>,
    fixed: bool,
}

struct Row {
    label: &'static str,
    overlap: bool,
    param: f32,
    fixed: bool,
    ppl: f64,
    depth: f64,
    agreement: Option<f64>,
    /// Learned lookahead only: mean per-token NLL minus the delayed gate's on the same tokens,
    /// and its standard error over windows (tokens of one window are not independent).
    nll_vs_delayed: Option<(f64, f64)>,
    seconds: f64,
}

struct Args {
    model: String,
    gates: Option<String>,
    heldout: String,
    sequences: usize,
    width: usize,
    write: Option<String>,
    json: Option<String>,
    traces: Option<String>,
    trace_qs: Vec<f32>,
}

fn parse(root: &str) -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        model: format!("{root}/assets/tiny-ouro"),
        gates: None,
        heldout: format!("{root}/corpus/heldout.txt"),
        sequences: 32,
        width: 8,
        write: None,
        json: None,
        traces: None,
        trace_qs: vec![0.2],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = v()?,
            "--gates" => a.gates = Some(v()?),
            "--heldout" => a.heldout = v()?,
            "--sequences" => a.sequences = v()?.parse()?,
            "--width" => a.width = v()?.parse()?,
            "--write" => a.write = Some(v()?),
            "--json" => a.json = Some(v()?),
            "--traces" => a.traces = Some(v()?),
            "--trace-q" => a.trace_qs = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

/// Per window: (log-probabilities of the forced tokens, loop steps of each token).
type Scored = Vec<(Vec<f32>, Vec<u32>)>;

fn run(
    model: &str,
    args: &Args,
    steps: usize,
    gate: Box<dyn ExitGate>,
    overlap: bool,
    windows: &[&[u32]],
) -> Result<(Scored, f64), Box<dyn std::error::Error>> {
    let mut engine = EngineBuilder::new(model)
        .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(KvLayoutKind::LastExited).exit_gate_boxed(gate))
        .max_num_seqs(args.width)
        .kv_capacity_tokens(args.width * (PROMPT + SCORED + 16) * steps)
        .build()?;
    engine.set_overlap(overlap)?;
    let mut index = HashMap::new();
    for (i, w) in windows.iter().enumerate() {
        let params = GenerationParams { forced_tokens: w[PROMPT..].to_vec(), ignore_eos: true, ..GenerationParams::greedy(SCORED) };
        index.insert(engine.add_request(w[..PROMPT].to_vec(), params)?, i);
    }
    let mut scored: Scored = vec![(Vec::new(), Vec::new()); windows.len()];
    while engine.has_work() {
        for ev in engine.step()? {
            if let ponder::Event::Token { id, logprob, compute, .. } = ev {
                let s = &mut scored[index[&id]];
                s.0.extend(logprob.map(|l| l.logprob));
                let Some(ponder::TokenCompute::LoopSteps(steps)) = compute else {
                    return Err("the depth scheduler reports each token's loop steps".into());
                };
                s.1.push(steps);
            }
        }
    }
    Ok((scored, engine.metrics().looped().unwrap().mean_depth()))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = env!("CARGO_MANIFEST_DIR");
    let args = parse(root)?;
    let gates_dir = args.gates.clone().unwrap_or_else(|| args.model.clone());
    let lookahead_head = Path::new(&gates_dir).join("lookahead_exit_gate.safetensors");
    let preloop_head = Path::new(&gates_dir).join("preloop_exit_gate.safetensors");
    for p in [&lookahead_head, &preloop_head] {
        if !p.exists() {
            return Err(format!("{} is missing: train the heads with tools/train/train_gate.py or pass --gates DIR", p.display()).into());
        }
    }
    let held = read_heldout(&args.heldout)?;
    let started = Instant::now();
    let probe = EngineBuilder::new(&args.model).build()?;
    let ids = probe.encode(&held)?;
    let steps = probe.spec().looped().ok_or("the gate report needs a looped model")?.max_steps;
    drop(probe);
    let (windows, picked, total_windows) = evenly_spaced_windows(&ids, PROMPT + SCORED, args.sequences);
    if windows.is_empty() {
        return Err(format!("{}: {} tokens, not enough for one {}-token window", args.heldout, ids.len(), PROMPT + SCORED).into());
    }
    println!("{} held-out tokens; scoring {} of {total_windows} windows x {SCORED} tokens", ids.len(), windows.len());

    let (la, pl) = (lookahead_head.clone(), preloop_head.clone());
    let depths: Vec<f32> = (1..=steps).map(|d| d as f32).collect();
    let configs = vec![
        Config {
            label: "(a) stock, synchronous",
            stem: "stock-sync",
            overlap: false,
            make: Box::new(move |q| Ok(Box::new(QExit::new(q, 2, steps)?))),
            params: QS.to_vec(),
            fixed: false,
        },
        Config {
            label: "(b) stock, delayed one step",
            stem: "delayed",
            overlap: true,
            make: Box::new(move |q| Ok(Box::new(Lookahead::new(QExit::new(q, 1, steps)?)?))),
            params: QS.to_vec(),
            fixed: false,
        },
        Config {
            label: "(c) learned lookahead",
            stem: "learned",
            overlap: true,
            make: Box::new(move |q| Ok(Box::new(LearnedLookahead::load(&la, q, 1, steps)?))),
            params: QS.to_vec(),
            fixed: false,
        },
        Config {
            label: "(d) preloop",
            stem: "preloop",
            overlap: true,
            make: Box::new(move |q| Ok(Box::new(Preloop::load(&pl, q, 2, steps)?))),
            params: QS.to_vec(),
            fixed: false,
        },
        Config {
            label: "(e) fixed depth",
            stem: "fixed",
            overlap: true,
            make: Box::new(|d| Ok(Box::new(FixedDepth::new(d as usize)?))),
            params: depths,
            fixed: true,
        },
    ];

    let mut rows = Vec::new();
    // (a)'s per-token depths by q, the reference of the agreement column; (b)'s log-probabilities
    // by q, the reference of the learned lookahead's paired perplexity comparison.
    let mut reference: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
    let mut delayed_lps: HashMap<u32, Vec<Vec<f32>>> = HashMap::new();
    for c in &configs {
        for &p in &c.params {
            let t0 = Instant::now();
            let (scored, depth) = run(&args.model, &args, steps, (c.make)(p)?, c.overlap, &windows)?;
            let lps: Vec<f32> = scored.iter().flat_map(|s| s.0.iter().copied()).collect();
            let ppl = (-lps.iter().map(|&l| l as f64).sum::<f64>() / lps.len() as f64).exp();
            let per_token: Vec<Vec<u32>> = scored.iter().map(|s| s.1.clone()).collect();
            let key = p.to_bits();
            if !c.fixed && c.stem == "stock-sync" {
                reference.insert(key, per_token.clone());
            }
            let by_window: Vec<Vec<f32>> = scored.iter().map(|s| s.0.clone()).collect();
            if c.stem == "delayed" {
                delayed_lps.insert(key, by_window.clone());
            }
            let nll_vs_delayed = (c.stem == "learned").then(|| paired_difference(&delayed_lps[&key], &by_window));
            let agreement = (!c.fixed).then(|| {
                let a = &reference[&key];
                let pairs = a.iter().zip(&per_token).flat_map(|(x, y)| x.iter().zip(y).skip(1));
                let (same, n) = pairs.fold((0usize, 0usize), |(s, n), (x, y)| (s + usize::from(x == y), n + 1));
                same as f64 / n.max(1) as f64
            });
            if let (Some(dir), false) = (&args.traces, c.fixed) {
                if args.trace_qs.contains(&p) {
                    let out = Path::new(dir).join(format!("q{p}"));
                    std::fs::create_dir_all(&out)?;
                    let map: serde_json::Map<String, serde_json::Value> =
                        per_token.iter().enumerate().map(|(i, d)| (i.to_string(), serde_json::json!(d))).collect();
                    let doc = serde_json::json!({ "gate": c.label, "q": p, "model": shown(&args.model, root), "depths": map });
                    std::fs::write(out.join(format!("{}.json", c.stem)), serde_json::to_string(&doc)? + "\n")?;
                }
            }
            let seconds = t0.elapsed().as_secs_f64();
            let shown_p = if c.fixed { format!("d={p}") } else { format!("q={p}") };
            println!(
                "{:>28} {shown_p:<6} perplexity {ppl:>8.3}  mean depth {depth:.3}  agreement {}  ({seconds:.1} s)",
                c.label,
                agreement.map_or("-".into(), |a| format!("{:.3}", a))
            );
            rows.push(Row { label: c.label, overlap: c.overlap, param: p, fixed: c.fixed, ppl, depth, agreement, nll_vs_delayed, seconds });
        }
    }
    let total = started.elapsed().as_secs_f64();
    let training =
        std::fs::read_to_string(Path::new(&gates_dir).join("gate_training_config.json")).ok().and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    if let Some(path) = &args.json {
        let results: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "gate": r.label, "overlap": r.overlap, "q": (!r.fixed).then_some(r.param), "fixed_depth": r.fixed.then_some(r.param as usize),
                    "perplexity": r.ppl, "mean_depth": r.depth, "agreement_with_stock_sync": r.agreement,
                    "nll_minus_delayed": r.nll_vs_delayed.map(|d| d.0), "nll_minus_delayed_se": r.nll_vs_delayed.map(|d| d.1), "seconds": r.seconds,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "model": shown(&args.model, root), "gates": shown(&gates_dir, root), "heldout": shown(&args.heldout, root),
            "heldout_tokens": ids.len(), "windows_total": total_windows, "window_indices": picked,
            "prompt_tokens": PROMPT, "scored_tokens": SCORED, "max_steps": steps, "layout": "last-exited",
            "device": "cpu", "dtype": "f32", "scheduler": "cdb-refill", "max_num_seqs": args.width,
            "training": training.as_ref().map(|t| serde_json::json!({ "settings": t["settings"], "data": t["data"], "device": t["device"], "train_seconds": t["train_seconds"] })),
            "total_seconds": total, "results": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        println!("wrote {path}");
    }
    if let Some(path) = &args.write {
        let mut md = format!(
            "Produced by `cargo run --release --example quality_gates -- --sequences {} --write docs/QUALITY.md \
             --json docs/bench/quality_gates_tiny_ouro.json` (CPU, f32, continuous depth batching with refill, \
             last-exited KV, width {}; {total:.0} s on the 2-core development machine). Model `{}`, heads from `{}`; \
             the same {} held-out windows ({} scored tokens) as the table above.\n\n",
            windows.len(),
            args.width,
            shown(&args.model, root),
            shown(&gates_dir, root),
            windows.len(),
            windows.len() * SCORED
        );
        md += "| q | (a) stock sync: ppl / depth | (b) delayed: ppl / depth / agree | (c) learned lookahead: ppl / depth / agree | (c) − (b): NLL per token ± 2 se | (d) preloop: ppl / depth / agree |\n";
        md += "|---|---|---|---|---|---|\n";
        for q in QS {
            let cell = |stem_label: &str| {
                rows.iter().find(|r| r.label == stem_label && !r.fixed && r.param == q).map(|r| match r.agreement {
                    Some(a) if !stem_label.starts_with("(a)") => format!("{:.2} / {:.2} / {:.0} %", r.ppl, r.depth, 100.0 * a),
                    _ => format!("{:.2} / {:.2}", r.ppl, r.depth),
                })
            };
            let labels = ["(a) stock, synchronous", "(b) stock, delayed one step", "(c) learned lookahead", "(d) preloop"];
            let mut cells: Vec<String> = labels.iter().map(|l| cell(l).unwrap_or_default()).collect();
            let paired = rows.iter().find(|r| r.label == labels[2] && r.param == q).and_then(|r| r.nll_vs_delayed);
            cells.insert(3, paired.map_or(String::new(), |(d, se)| format!("{d:+.4} ± {:.4}", 2.0 * se)));
            md += &format!("| {q} | {} |\n", cells.join(" | "));
        }
        md += "\n| (e) fixed depth | perplexity | mean depth |\n|---|---:|---:|\n";
        for r in rows.iter().filter(|r| r.fixed) {
            md += &format!("| d = {} | {:.2} | {:.2} |\n", r.param, r.ppl, r.depth);
        }
        splice(path, BEGIN, END, &md)?;
        println!("wrote {path}");
    }
    Ok(())
}

/// Per-token NLL of `b` minus that of `a` on the same tokens (positive: `b` is worse): the mean
/// over all tokens and its standard error from the spread of the per-window mean differences.
fn paired_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f64, f64) {
    let per_window: Vec<(f64, usize)> =
        a.iter().zip(b).map(|(x, y)| (x.iter().zip(y).map(|(&p, &q)| p as f64 - q as f64).sum::<f64>(), x.len().min(y.len()))).collect();
    let tokens: usize = per_window.iter().map(|w| w.1).sum();
    let mean = per_window.iter().map(|w| w.0).sum::<f64>() / tokens.max(1) as f64;
    let means: Vec<f64> = per_window.iter().filter(|w| w.1 > 0).map(|w| w.0 / w.1 as f64).collect();
    let n = means.len().max(2) as f64;
    let m = means.iter().sum::<f64>() / n;
    let var = means.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}
