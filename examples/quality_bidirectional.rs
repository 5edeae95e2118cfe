//! What Fast-dLLM's caches cost in quality on a trained bidirectional model: the shipped tiny
//! LLaDA (`assets/tiny-llada`, trained by `tools/train/train_llada.py` on the tiny SDAR's corpus),
//! CPU, f32.
//!
//! Prompts of 48 held-out tokens, 32 generated tokens (greedy, eos ignored), windows evenly spaced
//! over the held-out windows without an end-of-document token. Each is decoded with semi-AR
//! blocks of 16 from the prompt's end under LLaDA's linear schedule with 16 steps per block (one
//! token per step, the references' quality setting) and 4 steps per block (four per step), and
//! Fast-dLLM's threshold 0.9; each in the three canvas modes: exact (the whole canvas every step),
//! prefix cache and dual cache. Reported: exact match of the generated tokens against the true
//! continuation (position by position), agreement with the exact mode's tokens, positions run
//! through the network per step, and wall time.
//!
//! ```text
//! cargo run --release --example quality_bidirectional -- [--model assets/tiny-llada]
//!     [--heldout corpus/heldout.txt] [--prompts 128] [--write docs/QUALITY.md]
//!     [--json docs/bench/quality_tiny_llada.json]
//! ```
//!
//! The held-out text comes from `python3 tools/train/make_corpus.py --out corpus`.
//! `--write FILE` replaces the part of FILE between `<!-- quality:llada:begin -->` and
//! `<!-- quality:llada:end -->`.

use ponder::diffusion::{CanvasCache, LinearSchedule, Threshold, UnmaskPolicy};
use ponder::{EngineBuilder, GenerationParams};
use std::time::Instant;

#[path = "shared/report.rs"]
mod report;
use report::{shown, splice};

const PROMPT: usize = 48;
const NEW: usize = 32;
const BLOCK: usize = 16;
const BEGIN: &str = "<!-- quality:llada:begin -->";
const END: &str = "<!-- quality:llada:end -->";

/// An unmask policy for a number of steps per block.
type MakePolicy = fn(usize) -> Box<dyn UnmaskPolicy>;

struct Row {
    schedule: String,
    cache: CanvasCache,
    exact_match: f64,
    agreement: f64,
    positions_per_step: f64,
    tokens_per_step: f64,
    seconds: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = env!("CARGO_MANIFEST_DIR");
    let (mut model, mut heldout, mut prompts, mut write, mut json) =
        (format!("{root}/assets/tiny-llada"), format!("{root}/corpus/heldout.txt"), 128usize, None::<String>, None::<String>);
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--model" => model = v()?,
            "--heldout" => heldout = v()?,
            "--prompts" => prompts = v()?.parse()?,
            "--write" => write = Some(v()?),
            "--json" => json = Some(v()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let probe = EngineBuilder::new(&model).build()?;
    let tok = probe.tokenizer().ok_or("the model directory has no tokenizer.json")?.clone();
    let eos = probe.eos_token_ids().to_vec();
    drop(probe);
    let text = std::fs::read_to_string(&heldout).map_err(|e| format!("{heldout}: {e} (run tools/train/make_corpus.py --out corpus)"))?;
    let ids: Vec<u32> = tok.encode(text.as_str(), false).map_err(|e| e.to_string())?.get_ids().to_vec();
    let windows: Vec<&[u32]> = ids.chunks_exact(PROMPT + NEW).filter(|w| !w.iter().any(|t| eos.contains(t))).collect();
    let n = prompts.min(windows.len());
    let picked: Vec<&[u32]> = (0..n).map(|i| windows[i * windows.len() / n]).collect();
    println!("{n} prompts of {PROMPT} held-out tokens ({} eos-free windows), {NEW} new tokens, blocks of {BLOCK}", windows.len());
    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(NEW) };
    let schedules: Vec<(String, usize, MakePolicy)> = vec![
        ("linear, 16 steps per block (1 token per step)".into(), 16, |s| Box::new(LinearSchedule::new(s).unwrap())),
        ("linear, 4 steps per block (4 tokens per step)".into(), 4, |s| Box::new(LinearSchedule::new(s).unwrap())),
        ("threshold 0.9 (at most 16 steps per block)".into(), 16, |_| Box::new(Threshold::new(0.9).unwrap())),
    ];
    let mut rows = Vec::new();
    for (name, steps, make) in &schedules {
        let mut exact_tokens: Option<Vec<Vec<u32>>> = None;
        for cache in [CanvasCache::Exact, CanvasCache::Prefix, CanvasCache::Dual] {
            let mut engine = EngineBuilder::new(&model)
                .max_num_seqs(16)
                .diffusion(|o| o.block_length(BLOCK).max_steps_per_block(*steps).canvas_cache(cache).unmask_policy_boxed(make(*steps)))
                .build()?;
            let t = Instant::now();
            let outs: Vec<Vec<u32>> =
                engine.generate(picked.iter().map(|w| w[..PROMPT].to_vec()), &params)?.into_iter().map(|o| o.map(|o| o.token_ids)).collect::<Result<_, _>>()?;
            let seconds = t.elapsed().as_secs_f64();
            let same = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(x, y)| x == y).count();
            let matched: usize = outs.iter().zip(&picked).map(|(o, w)| same(o, &w[PROMPT..])).sum();
            let exact = exact_tokens.get_or_insert_with(|| outs.clone());
            let agreed: usize = outs.iter().zip(exact.iter()).map(|(o, e)| same(o, e)).sum();
            let d = engine.metrics().denoise().expect("a diffusion engine").clone();
            let row = Row {
                schedule: name.clone(),
                cache,
                exact_match: matched as f64 / (n * NEW) as f64,
                agreement: agreed as f64 / (n * NEW) as f64,
                positions_per_step: d.step_tokens as f64 / d.steps.max(1) as f64,
                tokens_per_step: engine.metrics().generated_tokens as f64 / d.steps.max(1) as f64,
                seconds,
            };
            println!(
                "{name:<48} {cache:<7?} exact match {:5.1} %  agrees with exact {:5.1} %  positions/step {:6.1}  tokens/step {:4.2}  {seconds:5.1} s",
                100.0 * row.exact_match,
                100.0 * row.agreement,
                row.positions_per_step,
                row.tokens_per_step
            );
            rows.push(row);
        }
    }
    let training: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(format!("{model}/training.json"))?)?;
    let acc = |r: &str| training["heldout_final"][r]["acc"].as_f64().unwrap_or(f64::NAN) * 100.0;
    let mut md = format!(
        "## Tiny LLaDA: exact decoding against Fast-dLLM's caches\n\n\
         Produced by `cargo run --release --example quality_bidirectional -- --prompts {n} --write docs/QUALITY.md \
         --json docs/bench/quality_tiny_llada.json` (CPU, f32) on `{}` ({} parameters, trained by \
         `tools/train/train_llada.py` for {} s on the H200 on the tiny SDAR's corpus and tokenizer; held-out masked-token \
         accuracy with the whole sequence visible {:.1} / {:.1} / {:.1} / {:.1} % at mask ratios 0.15 / 0.5 / 0.85 / 1.0). \
         {n} prompts of {PROMPT} held-out tokens, {NEW} new tokens each (greedy, eos ignored), semi-AR blocks of {BLOCK} from the \
         prompt's end. *Exact match*: generated tokens equal to the true continuation, position by position. *Agrees*: equal \
         to the exact mode's tokens. *Positions/step*: positions run through the network per request-step.\n\n\
         | schedule | canvas | exact match | agrees with exact | positions/step | tokens/step | wall s |\n|---|---|---:|---:|---:|---:|---:|\n",
        shown(&model, root),
        training["parameters"],
        training["train_seconds"],
        acc("0.15"),
        acc("0.5"),
        acc("0.85"),
        acc("1.0"),
    );
    for r in &rows {
        md += &format!(
            "| {} | {:?} | {:.1} % | {:.1} % | {:.1} | {:.2} | {:.1} |\n",
            r.schedule,
            r.cache,
            100.0 * r.exact_match,
            100.0 * r.agreement,
            r.positions_per_step,
            r.tokens_per_step,
            r.seconds
        );
    }
    md += "\n";
    if let Some(path) = &write {
        splice(path, BEGIN, END, &md)?;
        println!("wrote {path}");
    }
    if let Some(path) = &json {
        let doc = serde_json::json!({
            "model": shown(&model, root), "prompts": n, "prompt_tokens": PROMPT, "new_tokens": NEW, "block": BLOCK,
            "rows": rows.iter().map(|r| serde_json::json!({
                "schedule": r.schedule, "canvas": format!("{:?}", r.cache), "exact_match": r.exact_match, "agreement_with_exact": r.agreement,
                "positions_per_step": r.positions_per_step, "tokens_per_step": r.tokens_per_step, "seconds": r.seconds,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        println!("wrote {path}");
    }
    Ok(())
}
