//! Quality of depth-adaptive serving on a shipped tiny model: held-out perplexity and realised
//! mean depth by exit threshold q, KV layout and gate timing, measured by teacher forcing
//! through the engine (continuous depth batching, CPU, f32).
//!
//!     cargo run --release --example quality -- [--model DIR] [--sequences 16]
//!         [--write docs/QUALITY.md] [--json docs/bench/quality_tiny_ouro.json]
//!
//! Held-out text: the chapters of "The Rust Programming Language" that the training split
//! leaves out (`tools/train/make_corpus.py`; chapter i with i % 20 == 7), read from the
//! toolchain's rust-docs. Each sequence: 32 prompt tokens, then 96 forced tokens scored.

use ponder::gate::{ExitGate, FixedDepth, Lookahead, QExit};
use ponder::testing::{rust_book_chapters, rust_book_dir};
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind, SchedulerKind};

const PROMPT: usize = 32;
const SCORED: usize = 96;
const QS: [f32; 6] = [0.1, 0.2, 0.4, 0.6, 0.8, 1.0];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut model = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro").to_string();
    let (mut sequences, mut write, mut json) = (16usize, None::<String>, None::<String>);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model = args.next().ok_or("--model needs a value")?,
            "--sequences" => sequences = args.next().ok_or("--sequences needs a value")?.parse()?,
            "--write" => write = Some(args.next().ok_or("--write needs a value")?),
            "--json" => json = Some(args.next().ok_or("--json needs a value")?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let held: String = rust_book_chapters(&rust_book_dir()?)?
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 20 == 7)
        .map(|(_, c)| c)
        .collect::<Vec<_>>()
        .join("\n\n");
    let probe = EngineBuilder::new(&model).build()?;
    let ids = probe.encode(&held)?;
    let steps = probe.spec().ok_or("the quality report needs a looped model")?.max_steps;
    let windows: Vec<&[u32]> = ids.chunks_exact(PROMPT + SCORED).take(sequences).collect();
    println!("{} held-out tokens; scoring {} sequences x {SCORED} tokens", ids.len(), windows.len());

    type MakeGate = Box<dyn Fn(f32) -> ponder::Result<Box<dyn ExitGate>>>;
    let plain: MakeGate = Box::new(move |q| Ok(Box::new(QExit::new(q, 1, steps)?)));
    let lookahead: MakeGate = Box::new(move |q| Ok(Box::new(Lookahead::new(QExit::new(q, 1, steps)?)?)));
    let min2: MakeGate = Box::new(move |q| Ok(Box::new(QExit::new(q, 2, steps)?)));
    let full: MakeGate = Box::new(move |_| Ok(Box::new(FixedDepth::new(steps)?)));
    let configs: Vec<(&str, KvLayoutKind, &MakeGate, &[f32])> = vec![
        ("q-exit", KvLayoutKind::LastExited, &plain, &QS),
        ("q-exit", KvLayoutKind::Shared, &plain, &QS),
        ("q-exit (min 2 steps)", KvLayoutKind::FirstThenShared, &min2, &QS),
        ("lookahead(q-exit)", KvLayoutKind::Shared, &lookahead, &QS),
        ("full depth", KvLayoutKind::DepthIndexed, &full, &[1.0]),
    ];
    let mut rows = Vec::new();
    for (gate_name, layout, make, qs) in configs {
        for &q in qs {
            let mut engine = EngineBuilder::new(&model)
                .scheduler(SchedulerKind::Depth { refill: true })
                .kv_layout(layout)
                .exit_gate_boxed(make(q)?)
                .max_num_seqs(8)
                .build()?;
            let prompts: Vec<Vec<u32>> = windows.iter().map(|w| w[..PROMPT].to_vec()).collect();
            let mut nll = 0.0f64;
            let mut n = 0usize;
            for (w, p) in windows.iter().zip(&prompts) {
                let params = GenerationParams {
                    forced_tokens: w[PROMPT..].to_vec(),
                    ignore_eos: true,
                    ..GenerationParams::greedy(SCORED)
                };
                engine.add_request(p.clone(), params)?;
            }
            while engine.has_work() {
                for ev in engine.step()? {
                    if let ponder::Event::Token { logprob: Some(lp), .. } = ev {
                        nll -= lp as f64;
                        n += 1;
                    }
                }
            }
            let ppl = (nll / n as f64).exp();
            let depth = engine.metrics().mean_depth();
            println!("{gate_name:>22} {:>18} q={q:<4} perplexity {ppl:>9.2}  mean depth {depth:.2}", layout_name(layout));
            rows.push((gate_name, layout, q, ppl, depth));
        }
    }
    if let Some(path) = json {
        let results: Vec<_> = rows
            .iter()
            .map(|(g, l, q, p, d)| serde_json::json!({ "gate": g, "layout": layout_name(*l), "q": q, "perplexity": p, "mean_depth": d }))
            .collect();
        let doc = serde_json::json!({ "model": model, "sequences": windows.len(), "prompt_tokens": PROMPT, "scored_tokens": SCORED, "results": results });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
        println!("wrote {path}");
    }
    if let Some(path) = write {
        let mut md = String::from(
            "# Quality\n\nProduced by `cargo run --release --example quality -- --write docs/QUALITY.md` \
             (CPU, f32, continuous depth batching with refill, width 8).\n\n",
        );
        md += &format!(
            "Model: `{model}`. Held-out text: the 5 chapters of *The Rust Programming Language* left out of training; \
             {} sequences of {PROMPT} prompt tokens + {SCORED} teacher-forced tokens. Perplexity is over the forced \
             tokens; the first comes from the full-depth prefill, the rest from the coda at each token's exit depth. \
             Mean depth counts first tokens at r_max = {steps}.\n\n",
            windows.len()
        );
        md += "| gate | KV layout | q | perplexity | mean depth |\n|---|---|---|---|---|\n";
        for (g, l, q, p, d) in &rows {
            md += &format!("| {g} | {} | {q} | {p:.2} | {d:.2} |\n", layout_name(*l));
        }
        std::fs::write(&path, md)?;
        println!("wrote {path}");
    }
    Ok(())
}

fn layout_name(l: KvLayoutKind) -> &'static str {
    l.build().name()
}
