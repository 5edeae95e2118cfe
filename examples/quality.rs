//! Quality of depth-adaptive serving on a shipped tiny looped model: held-out perplexity and
//! realised mean depth by exit threshold q, KV layout and gate timing, measured by teacher
//! forcing through the engine (continuous depth batching with refill, CPU, f32).
//!
//!     cargo run --release --example quality -- [--model assets/tiny-ouro]
//!         [--heldout corpus/heldout.txt] [--sequences 32] [--width 8]
//!         [--write docs/QUALITY.md] [--json docs/bench/quality_tiny_ouro.json]
//!
//! Held-out text: `corpus/heldout.txt` from `tools/train/make_corpus.py` (72 pages of twelve
//! rust-docs books that the training split leaves out). It is tokenized whole and cut into
//! windows of 32 prompt + 96 teacher-forced tokens; `--sequences` windows are taken evenly
//! spaced over the file (so every book contributes), and the forced tokens are scored.
//! `--width` is the engine's `max_num_seqs` (it changes the speed, not the numbers).
//!
//! Configurations: Q-exit for q in {0.1, 0.2, 0.4, 0.6, 0.8, 1.0} under the last-exited and
//! shared KV layouts, and under first-then-shared with at least 2 steps (a token exiting after
//! step 0 would leave its shared slot for steps >= 1 unwritten, which the builder refuses); the
//! lookahead gate (verdicts one step late) under shared and last-exited; fixed depth 1..4 under
//! last-exited (generated tokens cut to d loops; the prompt prefill runs at full depth); full
//! depth under depth-indexed (the layout Ouro is trained with; it cannot serve exits, for the
//! same reason).
//!
//! `--write FILE` replaces the part of FILE between `<!-- quality:ouro:begin -->` and
//! `<!-- quality:ouro:end -->` (appended when FILE has no markers, FILE created when missing),
//! so hand-written analysis around it survives a rerun.

use ponder::looped::gate::{ExitGate, FixedDepth, Lookahead, QExit};
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind, SchedulerKind};
use std::time::Instant;

#[path = "shared/report.rs"]
mod report;
use report::{shown, splice};
#[path = "shared/heldout.rs"]
mod heldout;
use heldout::{evenly_spaced_windows, read_heldout};

const PROMPT: usize = 32;
const SCORED: usize = 96;
const QS: [f32; 6] = [0.1, 0.2, 0.4, 0.6, 0.8, 1.0];
const BEGIN: &str = "<!-- quality:ouro:begin -->";
const END: &str = "<!-- quality:ouro:end -->";

type MakeGate = Box<dyn Fn(f32) -> ponder::Result<Box<dyn ExitGate>>>;

struct Row {
    gate: String,
    layout: KvLayoutKind,
    q: Option<f32>,
    fixed_depth: Option<usize>,
    ppl: f64,
    depth: f64,
    seconds: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut model = format!("{root}/assets/tiny-ouro");
    let mut heldout = format!("{root}/corpus/heldout.txt");
    let (mut sequences, mut width, mut write, mut json) = (32usize, 8usize, None::<String>, None::<String>);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model = args.next().ok_or("--model needs a value")?,
            "--heldout" => heldout = args.next().ok_or("--heldout needs a value")?,
            "--sequences" => sequences = args.next().ok_or("--sequences needs a value")?.parse()?,
            "--width" => width = args.next().ok_or("--width needs a value")?.parse()?,
            "--write" => write = Some(args.next().ok_or("--write needs a value")?),
            "--json" => json = Some(args.next().ok_or("--json needs a value")?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let held = read_heldout(&heldout)?;
    let started = Instant::now();
    let probe = EngineBuilder::new(&model).build()?;
    let ids = probe.encode(&held)?;
    let steps = probe.spec().looped().ok_or("the quality report needs a looped model")?.max_steps;
    drop(probe);
    let (windows, picked, total_windows) = evenly_spaced_windows(&ids, PROMPT + SCORED, sequences);
    if windows.is_empty() {
        return Err(format!("{heldout}: {} tokens, not enough for one {}-token window", ids.len(), PROMPT + SCORED).into());
    }
    println!(
        "{} held-out tokens, {} windows of {}; scoring {} of them (evenly spaced) x {SCORED} tokens",
        ids.len(),
        total_windows,
        PROMPT + SCORED,
        windows.len()
    );

    let plain: MakeGate = Box::new(move |q| Ok(Box::new(QExit::new(q, 1, steps)?)));
    let min2: MakeGate = Box::new(move |q| Ok(Box::new(QExit::new(q, 2, steps)?)));
    let lookahead: MakeGate = Box::new(move |q| Ok(Box::new(Lookahead::new(QExit::new(q, 1, steps)?)?)));
    let fixed: MakeGate = Box::new(move |d| Ok(Box::new(FixedDepth::new(d as usize)?)));
    let depths: Vec<f32> = (1..=steps).map(|d| d as f32).collect();
    // (gate name, layout, gate factory, parameter values, parameter is a fixed depth)
    let configs: Vec<(&str, KvLayoutKind, &MakeGate, &[f32], bool)> = vec![
        ("full depth", KvLayoutKind::DepthIndexed, &fixed, &depths[steps - 1..], true),
        ("fixed depth", KvLayoutKind::LastExited, &fixed, &depths, true),
        ("q-exit", KvLayoutKind::LastExited, &plain, &QS, false),
        ("q-exit", KvLayoutKind::Shared, &plain, &QS, false),
        ("q-exit (min 2 steps)", KvLayoutKind::FirstThenShared, &min2, &QS, false),
        ("lookahead(q-exit)", KvLayoutKind::Shared, &lookahead, &QS, false),
        ("lookahead(q-exit)", KvLayoutKind::LastExited, &lookahead, &QS, false),
    ];
    let mut rows = Vec::new();
    let progress = indicatif::ProgressBar::new(configs.iter().map(|c| c.3.len() as u64).sum());
    progress.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} configurations, {elapsed} ({eta} left) {msg}").expect("valid template"));
    for (gate_name, layout, make, params, is_depth) in configs {
        for &p in params {
            progress.set_message(format!("{gate_name} {p}"));
            let t0 = Instant::now();
            let gate = make(p)?;
            let mut engine = EngineBuilder::new(&model)
                .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(layout).exit_gate_boxed(gate))
                .max_num_seqs(width)
                // Room for the live requests only (the default, 16 384 positions per slot, is
                // hundreds of MB to zero per configuration).
                .kv_capacity_tokens(width * (PROMPT + SCORED + 16) * steps)
                .build()?;
            for w in &windows {
                let params = GenerationParams { forced_tokens: w[PROMPT..].to_vec(), ignore_eos: true, ..GenerationParams::greedy(SCORED) };
                engine.add_request(w[..PROMPT].to_vec(), params)?;
            }
            let (mut nll, mut count) = (0.0f64, 0usize);
            while engine.has_work() {
                for ev in engine.step()? {
                    if let ponder::Event::Token { logprob: Some(lp), .. } = ev {
                        nll -= lp.logprob as f64;
                        count += 1;
                    }
                }
            }
            let ppl = (nll / count as f64).exp();
            let depth = engine.metrics().looped().unwrap().mean_depth();
            let (q, fixed_depth) = if is_depth { (None, Some(p as usize)) } else { (Some(p), None) };
            let label = match fixed_depth {
                Some(d) => format!("d={d}"),
                None => format!("q={p}"),
            };
            let seconds = t0.elapsed().as_secs_f64();
            progress.println(format!("{gate_name:>22} {:>18} {label:<6} perplexity {ppl:>9.2}  mean depth {depth:.2}  ({seconds:.1} s)", layout_name(layout)));
            progress.inc(1);
            rows.push(Row { gate: gate_name.to_string(), layout, q, fixed_depth, ppl, depth, seconds });
        }
    }
    progress.finish_and_clear();
    let total = started.elapsed().as_secs_f64();
    println!("{} configurations in {total:.0} s", rows.len());
    let shown_model = shown(&model, root);
    let shown_heldout = shown(&heldout, root);
    if let Some(path) = json {
        let results: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "gate": r.gate, "layout": layout_name(r.layout), "q": r.q, "fixed_depth": r.fixed_depth,
                    "perplexity": r.ppl, "mean_depth": r.depth, "seconds": r.seconds,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "model": shown_model, "heldout": shown_heldout, "heldout_tokens": ids.len(),
            "windows_total": total_windows, "sequences": windows.len(), "window_indices": picked,
            "prompt_tokens": PROMPT, "scored_tokens": SCORED, "max_steps": steps,
            "device": "cpu", "dtype": "f32", "scheduler": "cdb-refill", "max_num_seqs": width,
            "total_seconds": total, "results": results,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
        println!("wrote {path}");
    }
    if let Some(path) = write {
        let width_arg = if width == 8 { String::new() } else { format!(" --width {width}") };
        let mut md = format!(
            "Produced by `cargo run --release --example quality -- --sequences {}{width_arg} --write docs/QUALITY.md \
             --json docs/bench/quality_tiny_ouro.json` (CPU, f32, continuous depth batching with refill, \
             width {width}; {total:.0} s on the 2-core development machine).\n\n",
            windows.len()
        );
        md += &format!(
            "Model: `{shown_model}`. Held-out text: `{shown_heldout}` ({} tokens); {} windows of {PROMPT} prompt \
             tokens + {SCORED} teacher-forced tokens, evenly spaced over the file ({} of its {} non-overlapping \
             windows), so {} tokens are scored per row. Perplexity is over the forced tokens: the first comes \
             from the full-depth prefill, the rest from the LM head at each token's exit step. Mean depth \
             counts loop steps per scored token (the first token at r_max = {steps}).\n\n",
            ids.len(),
            windows.len(),
            windows.len(),
            total_windows,
            windows.len() * SCORED
        );
        md += "| gate | KV layout | q / depth | perplexity | mean depth |\n|---|---|---|---:|---:|\n";
        for r in &rows {
            let p = match (r.q, r.fixed_depth) {
                (_, Some(d)) => format!("d = {d}"),
                (Some(q), None) => format!("q = {q}"),
                _ => String::new(),
            };
            md += &format!("| {} | {} | {p} | {:.2} | {:.2} |\n", r.gate, layout_name(r.layout), r.ppl, r.depth);
        }
        md += "\n![held-out perplexity vs mean depth](bench/quality_tiny_ouro.svg)\n";
        splice(&path, BEGIN, END, &md)?;
        println!("wrote {path}");
    }
    Ok(())
}

fn layout_name(l: KvLayoutKind) -> &'static str {
    l.build().name()
}
