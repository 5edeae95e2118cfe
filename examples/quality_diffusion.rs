//! Quality of block-diffusion decoding on the shipped tiny SDAR (CPU, f32):
//!
//! 1. **Masked-token prediction on held-out text**, straight through the model API: held-out
//!    windows of 256 tokens (16 blocks of 16); for every block b and mask ratio r in
//!    {0.15, 0.5, 0.85, 1.0}, each token of block b is replaced by `<|mask|>` with probability r
//!    (seeded), blocks 0..b stay clean as context (block-causal attention, exactly what
//!    `tools/train/train_sdar.py` evaluates), and the masked positions are scored: accuracy of
//!    the argmax and perplexity exp(mean CE). One launch per window: a clean row that writes the
//!    window's K/V, plus one row per (ratio, block) whose pages are the clean pages of the earlier
//!    blocks and a private page for its noisy block.
//! 2. **Decoding through the engine** (`EngineBuilder`, threshold unmasking τ in
//!    {0.3, 0.5, 0.7, 0.8, 0.9}, delayed cache off/on, FOCUS (α 1.5, on the delayed cache) on/off,
//!    and one token per step as the slow reference). The delayed-cache runs also score every step
//!    with FOCUS in shadow mode (everything still runs) to measure its recall: the share of the
//!    tokens this baseline decodes that FOCUS would have kept.
//!    prompts of 48 held-out tokens (3 blocks), 32 generated tokens (2 blocks, greedy, eos
//!    ignored), windows evenly spaced over the held-out windows that hold no end-of-document
//!    token. Reported: tokens decoded per denoising step and tokens recomputed per step (engine
//!    metrics), exact-match rate of the generated tokens against the true held-out continuation
//!    (position by position), and the perplexity that a different model, the tiny Ouro
//!    (`--judge`, full depth), assigns to the generated continuation given the prompt: a
//!    cross-model judge, printed next to its perplexity of the true continuation. Ouro's own
//!    greedy continuation is scored for exact match too (an autoregressive reference; the judge
//!    is not applied to it, it would be judging itself).
//!
//! Usage:
//!
//! ```text
//! cargo run --release --example quality_diffusion -- [--model assets/tiny-sdar]
//!     [--judge assets/tiny-ouro] [--heldout corpus/heldout.txt] [--windows 345]
//!     [--prompts 128] [--taus 0.3,0.5,0.7,0.8,0.9] [--seed 2026]
//!     [--write docs/QUALITY.md] [--json docs/bench/quality_tiny_sdar.json]
//! ```
//!
//! `--write FILE` replaces the part of FILE between `<!-- quality:sdar:begin -->` and
//! `<!-- quality:sdar:end -->` (appended when FILE has no markers, FILE created when missing).

use ponder::diffusion::models::{self, DiffusionModel};
use ponder::diffusion::{Focus, StaticCount, Threshold, UnmaskPolicy};
use ponder::loader::ModelDir;
use ponder::{DType, Device, EngineBuilder, GenerationParams};

#[path = "shared/masked.rs"]
mod masked;
use masked::{masked_token_stats, RATIOS, SEQ};
#[path = "shared/report.rs"]
mod report;
use report::{shown, splice};
use std::time::Instant;

const PROMPT: usize = 48;
const NEW: usize = 32;
const BEGIN: &str = "<!-- quality:sdar:begin -->";
const END: &str = "<!-- quality:sdar:end -->";

struct Args {
    model: String,
    judge: String,
    heldout: String,
    windows: Option<usize>,
    prompts: usize,
    taus: Vec<f32>,
    seed: u64,
    write: Option<String>,
    json: Option<String>,
}

fn parse(root: &str) -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        model: format!("{root}/assets/tiny-sdar"),
        judge: format!("{root}/assets/tiny-ouro"),
        heldout: format!("{root}/corpus/heldout.txt"),
        windows: None,
        prompts: 128,
        taus: vec![0.3, 0.5, 0.7, 0.8, 0.9],
        seed: 2026,
        write: None,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--model" => a.model = v()?,
            "--judge" => a.judge = v()?,
            "--heldout" => a.heldout = v()?,
            "--windows" => a.windows = Some(v()?.parse()?),
            "--prompts" => a.prompts = v()?.parse()?,
            "--taus" => a.taus = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--seed" => a.seed = v()?.parse()?,
            "--write" => a.write = Some(v()?),
            "--json" => a.json = Some(v()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

struct DecodeRow {
    policy: String,
    tau: Option<f32>,
    delayed: bool,
    focus: bool,
    /// FOCUS rows: tokens a step kept past layer 1.
    kept_per_step: Option<f64>,
    /// Delayed-cache rows: FOCUS's shadow recall of the tokens decoded.
    recall: Option<f64>,
    tokens_per_step: f64,
    recomputed_per_step: f64,
    steps: u64,
    exact_match: f64,
    exact_match_block1: f64,
    exact_match_block2: f64,
    judge_ppl: f64,
    seconds: f64,
    sample: String,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = env!("CARGO_MANIFEST_DIR");
    let args = parse(root)?;
    let started = Instant::now();
    let held = std::fs::read_to_string(&args.heldout).map_err(|e| {
        format!(
            "cannot read the held-out text {} ({e}). Build the corpus first: `python3 tools/train/make_corpus.py` \
             (writes corpus/train.txt and corpus/heldout.txt from the Rust toolchain's rust-docs component), \
             or pass --heldout FILE",
            args.heldout
        )
    })?;
    let dev = Device::Cpu;
    let dir = ModelDir::open(&args.model)?;
    let tok = dir.tokenizer()?.ok_or("the model directory has no tokenizer.json")?;
    let ids: Vec<u32> = tok.encode(held.as_str(), false).map_err(|e| e.to_string())?.get_ids().to_vec();
    let model = models::load(&dir.config, &dir.weights(DType::F32, &dev)?)?;
    let spec = model.spec().clone();
    let b = spec.block_length.ok_or("the model's config names no block length")?;
    if SEQ % b != 0 || PROMPT % b != 0 {
        return Err(format!("block length {b} must divide {SEQ} and {PROMPT}").into());
    }
    let eos: Vec<u32> = vec![0];
    println!("{} held-out tokens; block length {b}, mask token {}", ids.len(), spec.mask_token_id);

    // ---- 1. masked-token prediction -------------------------------------------------------
    let all_windows: Vec<&[u32]> = ids.chunks_exact(SEQ).collect();
    let n_windows = args.windows.unwrap_or(all_windows.len()).min(all_windows.len());
    let t_masked = Instant::now();
    let progress = indicatif::ProgressBar::new(n_windows as u64);
    progress
        .set_style(indicatif::ProgressStyle::with_template("masked-token eval {bar:30} {pos}/{len} windows, {elapsed} ({eta} left)").expect("valid template"));
    let stats = masked_token_stats(&model, &all_windows[..n_windows], args.seed, || progress.inc(1))?;
    progress.finish_and_clear();
    let masked_seconds = t_masked.elapsed().as_secs_f64();
    println!("masked-token prediction over {n_windows} windows of {SEQ} ({masked_seconds:.0} s):");
    for (r, s) in RATIOS.iter().zip(&stats) {
        let ce = s.nll / s.count as f64;
        println!(
            "  ratio {r:<4}: accuracy {:5.1} %  CE {ce:.3}  perplexity {:7.2}  over {} masked tokens",
            100.0 * s.correct as f64 / s.count as f64,
            ce.exp(),
            s.count
        );
    }

    // ---- 2. decoding through the engine ----------------------------------------------------
    let candidates: Vec<&[u32]> = ids.chunks_exact(PROMPT + NEW).filter(|w| !w.iter().any(|t| eos.contains(t))).collect();
    let n = args.prompts.min(candidates.len());
    if n == 0 {
        return Err("no held-out window without an end-of-document token".into());
    }
    let picked: Vec<&[u32]> = (0..n).map(|i| candidates[i * candidates.len() / n]).collect();
    let prompts: Vec<Vec<u32>> = picked.iter().map(|w| w[..PROMPT].to_vec()).collect();
    let truths: Vec<&[u32]> = picked.iter().map(|w| &w[PROMPT..]).collect();
    println!("decoding: {n} prompts of {PROMPT} tokens ({} eos-free windows of {}), {NEW} new tokens each", candidates.len(), PROMPT + NEW);
    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(NEW) };

    let mut judge = EngineBuilder::new(&args.judge).max_num_seqs(16).build()?;
    if judge.spec().looped().is_none() {
        return Err("--judge must be a looped model (the tiny Ouro)".into());
    }
    let mut judge_ppl = |conts: &[Vec<u32>]| -> Result<f64, Box<dyn std::error::Error>> {
        let (mut nll, mut count) = (0.0f64, 0usize);
        for (p, c) in prompts.iter().zip(conts) {
            judge.add_request(p.clone(), GenerationParams { forced_tokens: c.clone(), ..params.clone() })?;
        }
        while judge.has_work() {
            for ev in judge.step()? {
                if let ponder::Event::Token { logprob: Some(lp), .. } = ev {
                    nll -= lp.logprob as f64;
                    count += 1;
                }
            }
        }
        Ok((nll / count.max(1) as f64).exp())
    };
    let truth_vecs: Vec<Vec<u32>> = truths.iter().map(|t| t.to_vec()).collect();
    let truth_judge = judge_ppl(&truth_vecs)?;
    println!("judge (tiny Ouro, full depth) perplexity of the true continuations: {truth_judge:.2}");

    let exact = |gen: &[Vec<u32>], range: std::ops::Range<usize>| -> f64 {
        let (mut hit, mut tot) = (0usize, 0usize);
        for (g, t) in gen.iter().zip(&truths) {
            for i in range.clone() {
                tot += 1;
                hit += (g.get(i) == t.get(i)) as usize;
            }
        }
        hit as f64 / tot.max(1) as f64
    };

    // Autoregressive reference: the tiny Ouro's own greedy continuation (full depth).
    let t0 = Instant::now();
    let mut ouro = EngineBuilder::new(&args.judge).max_num_seqs(16).build()?;
    let ouro_gen: Vec<Vec<u32>> = ouro.generate(prompts.clone(), &params)?.into_iter().map(|o| o.map(|o| o.token_ids)).collect::<Result<_, _>>()?;
    let ouro_ref = (exact(&ouro_gen, 0..NEW), exact(&ouro_gen, 0..b), exact(&ouro_gen, b..NEW), t0.elapsed().as_secs_f64());
    println!("tiny Ouro greedy (AR reference): exact match {:.1} %", 100.0 * ouro_ref.0);
    drop(ouro);

    // (name, τ, delayed cache, FOCUS)
    let mut configs: Vec<(String, Option<f32>, bool, bool)> = Vec::new();
    for &tau in &args.taus {
        for (delayed, focus) in [(false, false), (true, false), (true, true)] {
            configs.push((format!("threshold({tau})"), Some(tau), delayed, focus));
        }
    }
    configs.push(("static(1)".into(), None, false, false));
    let mut rows = Vec::new();
    for (name, tau, delayed, focus) in configs {
        let t0 = Instant::now();
        let policy: Box<dyn UnmaskPolicy> = match tau {
            Some(t) => Box::new(Threshold::new(t)?),
            None => Box::new(StaticCount::new(1)?),
        };
        let mut builder = EngineBuilder::new(&args.model).diffusion(|o| o.block_length(b).delayed_cache(delayed).unmask_policy_boxed(policy)).max_num_seqs(16);
        if delayed {
            // FOCUS evicts, or (baseline rows) only scores in shadow mode to measure its recall.
            builder = builder.diffusion(|o| o.eviction_policy(Focus::default()).eviction_shadow(!focus));
        }
        let mut engine = builder.build()?;
        let outs = engine.generate(prompts.clone(), &params)?;
        let gen: Vec<Vec<u32>> = outs.into_iter().map(|o| o.map(|o| o.token_ids)).collect::<Result<_, _>>()?;
        let seconds = t0.elapsed().as_secs_f64();
        let m = engine.metrics().clone();
        let jp = judge_ppl(&gen)?;
        let row = DecodeRow {
            policy: name,
            tau,
            delayed,
            focus,
            kept_per_step: focus.then(|| m.denoise().unwrap().kept_per_step()),
            recall: (delayed && !focus).then(|| m.denoise().unwrap().recall()).flatten(),
            tokens_per_step: (m.generated_tokens as f64 / m.denoise().unwrap().steps.max(1) as f64),
            recomputed_per_step: m.denoise().unwrap().tokens_per_step(),
            steps: m.denoise().unwrap().steps,
            exact_match: exact(&gen, 0..NEW),
            exact_match_block1: exact(&gen, 0..b),
            exact_match_block2: exact(&gen, b..NEW),
            judge_ppl: jp,
            seconds,
            sample: tok.decode(&gen[0], false).unwrap_or_default(),
        };
        println!(
            "  {:<15} delayed {:<3} focus {:<3}  tokens/step {:5.2}  recomputed/step {:5.2}  kept/step {}  recall {}  exact match {:5.1} %  judge ppl {:8.2}  ({seconds:.1} s)",
            row.policy,
            if delayed { "on" } else { "off" },
            if focus { "on" } else { "off" },
            row.tokens_per_step,
            row.recomputed_per_step,
            row.kept_per_step.map_or("-".into(), |k| format!("{k:.2}")),
            row.recall.map_or("-".into(), |r| format!("{:.1} %", 100.0 * r)),
            100.0 * row.exact_match,
            row.judge_ppl
        );
        rows.push(row);
    }
    let total = started.elapsed().as_secs_f64();
    println!("done in {total:.0} s");

    let shown_model = shown(&args.model, root);
    let shown_judge = shown(&args.judge, root);
    let shown_heldout = shown(&args.heldout, root);
    let prompt_text = tok.decode(&prompts[0], false).unwrap_or_default();
    let truth_text = tok.decode(truths[0], false).unwrap_or_default();
    let ouro_text = tok.decode(&ouro_gen[0], false).unwrap_or_default();
    if let Some(path) = &args.json {
        let masked: Vec<_> = RATIOS
            .iter()
            .zip(&stats)
            .map(|(r, s)| {
                let ce = s.nll / s.count as f64;
                serde_json::json!({ "mask_ratio": r, "accuracy": s.correct as f64 / s.count as f64, "ce": ce, "perplexity": ce.exp(), "masked_tokens": s.count })
            })
            .collect();
        let decoding: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "policy": r.policy, "tau": r.tau, "delayed_cache": r.delayed, "focus": r.focus,
                    "kept_per_step": r.kept_per_step, "focus_recall": r.recall,
                    "tokens_per_step": r.tokens_per_step, "recomputed_tokens_per_step": r.recomputed_per_step,
                    "denoise_steps": r.steps, "exact_match": r.exact_match,
                    "exact_match_block1": r.exact_match_block1, "exact_match_block2": r.exact_match_block2,
                    "judge_perplexity": r.judge_ppl, "seconds": r.seconds, "sample_continuation": r.sample,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "model": shown_model, "judge": shown_judge, "heldout": shown_heldout, "heldout_tokens": ids.len(),
            "device": "cpu", "dtype": "f32", "seed": args.seed, "block_length": b,
            "masked": { "window_tokens": SEQ, "windows": n_windows, "windows_total": all_windows.len(), "seconds": masked_seconds, "results": masked },
            "decoding": {
                "prompt_tokens": PROMPT, "new_tokens": NEW, "prompts": n, "eos_free_windows": candidates.len(),
                "max_num_seqs": 16, "ignore_eos": true,
                "judge_perplexity_true_continuation": truth_judge,
                "ouro_greedy_reference": { "exact_match": ouro_ref.0, "exact_match_block1": ouro_ref.1, "exact_match_block2": ouro_ref.2, "seconds": ouro_ref.3, "sample_continuation": ouro_text },
                "sample_prompt": prompt_text, "sample_truth": truth_text,
                "results": decoding,
            },
            "total_seconds": total,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        println!("wrote {path}");
    }
    if let Some(path) = &args.write {
        let mut md = format!(
            "Produced by `cargo run --release --example quality_diffusion -- --write docs/QUALITY.md --json \
             docs/bench/quality_tiny_sdar.json` (CPU, f32, seed {}; {total:.0} s on the 2-core development \
             machine). Model: `{shown_model}`; held-out text: `{shown_heldout}` ({} tokens).\n\n",
            args.seed,
            ids.len()
        );
        md += &format!(
            "**Masked-token prediction.** {n_windows} held-out windows of {SEQ} tokens ({} blocks of {b}; every \
             window of the file). For each block and mask ratio r, each token of the block is masked with \
             probability r; the earlier blocks of the window are clean context; the masked tokens are scored \
             (accuracy of the argmax, perplexity = exp(mean cross entropy)). The same protocol as the \
             trainer's final evaluation (other random masks).\n\n",
            SEQ / b
        );
        md += "| mask ratio | masked tokens | accuracy | cross entropy | perplexity |\n|---:|---:|---:|---:|---:|\n";
        for (r, s) in RATIOS.iter().zip(&stats) {
            let ce = s.nll / s.count as f64;
            md += &format!("| {r} | {} | {:.1} % | {ce:.3} | {:.2} |\n", s.count, 100.0 * s.correct as f64 / s.count as f64, ce.exp());
        }
        md += &format!(
            "\n**Decoding.** {n} prompts of {PROMPT} held-out tokens (evenly spaced over the {} windows of {} \
             tokens without an end-of-document token), {NEW} new tokens each (greedy, eos ignored, block \
             length {b}, at most {b} steps per block, 16 requests decoding together). *Tokens/step*: generated \
             tokens per request-step (generated tokens over `metrics().denoise()`'s steps); *recomputed/step*: tokens a step runs \
             through the network (`metrics().denoise()`'s `tokens_per_step()`; the delayed cache lowers it). \
             *Exact match*: generated token = true held-out token at the same position (tokens 1–{b} / \
             {}–{NEW} / all). *Judge perplexity*: the tiny Ouro's (`{shown_judge}`, full depth, teacher \
             forced) perplexity of the generated {NEW} tokens after the prompt — a different, autoregressive \
             model as judge, not the diffusion model scoring itself; it rewards fluent, predictable text, \
             including repetition, so read it together with exact match. On the true continuations the \
             judge's perplexity is **{truth_judge:.2}**. *FOCUS*: eviction with α = 1.5 on the delayed cache; \
             *kept/step*: tokens a FOCUS step ran past layer 1 (of the recomputed ones); *FOCUS recall* (on \
             the delayed-cache baseline rows): share of the tokens that baseline decoded which FOCUS, scoring \
             the same step in shadow mode, would have kept. The paper's own setting is FOCUS at τ = 0.8 \
             against the baseline at τ = 0.9 (not like-for-like: the threshold differs).\n\n",
            candidates.len(),
            PROMPT + NEW,
            b + 1
        );
        md += "| unmasking | delayed cache | FOCUS | tokens/step | recomputed/step | kept/step | FOCUS recall | exact match (1st block / 2nd / all) | judge perplexity |\n|---|---|---|---:|---:|---:|---:|---:|---:|\n";
        for r in &rows {
            md += &format!(
                "| {} | {} | {} | {:.2} | {:.2} | {} | {} | {:.1} % / {:.1} % / {:.1} % | {:.2} |\n",
                r.policy,
                if r.delayed { "on" } else { "off" },
                if r.focus { "on" } else { "off" },
                r.tokens_per_step,
                r.recomputed_per_step,
                r.kept_per_step.map_or("–".into(), |k| format!("{k:.2}")),
                r.recall.map_or("–".into(), |x| format!("{:.1} %", 100.0 * x)),
                100.0 * r.exact_match_block1,
                100.0 * r.exact_match_block2,
                100.0 * r.exact_match,
                r.judge_ppl
            );
        }
        md += &format!(
            "| *tiny Ouro greedy (AR reference)* | – | – | 1 | – | – | – | {:.1} % / {:.1} % / {:.1} % | (self) |\n",
            100.0 * ouro_ref.1,
            100.0 * ouro_ref.2,
            100.0 * ouro_ref.0
        );
        md += "\n![tiny SDAR quality](bench/quality_tiny_sdar.svg)\n\n";
        md += &format!(
            "Sample (first prompt), prompt `{}`; true continuation `{}`; threshold 0.9 without delayed cache: \
             `{}`.\n",
            one_line(&prompt_text),
            one_line(&truth_text),
            rows.iter().find(|r| r.tau == Some(0.9) && !r.delayed && !r.focus).map(|r| one_line(&r.sample)).unwrap_or_default()
        );
        splice(path, BEGIN, END, &md)?;
        println!("wrote {path}");
    }
    Ok(())
}

fn one_line(s: &str) -> String {
    s.replace('\n', "⏎").replace('`', "'")
}
