//! What FP8 costs in quality on the shipped tiny models (CPU): every row is measured three
//! times on the same held-out text: with the checkpoint's f32 weights; with
//! `Quantization::Fp8` (attention projections and MLPs in E4M3, one scale per output channel,
//! quantized at load; embeddings, norms, exit gate and LM head as they are), multiplying by the
//! dequantized weights (the weight-only kernel's numerics); and with the activations of every
//! FP8 layer quantized too (`fp8=w8a8`: E4M3 with a scale per token, the W8A8 GEMM's numerics,
//! which serving applies to launches of more than 16 rows).
//!
//! 1. **Tiny Ouro**: held-out perplexity by teacher forcing (windows of 32 prompt + 96 forced
//!    tokens, evenly spaced over the file), at full depth, at fixed depths 1..r_max and under
//!    Q-exit (q 0.2 / 0.5 / 0.8), continuous depth batching with refill on the last-exited
//!    layout; with the realised mean depth, since FP8 can move the exits too.
//! 2. **Tiny SDAR**: masked-token prediction on held-out windows of 256 tokens (each block
//!    masked at ratios 0.15 / 0.5 / 0.85 / 1.0 with the earlier blocks clean, as
//!    `quality_diffusion` scores it: argmax accuracy and perplexity of the masked tokens); and
//!    threshold decoding (τ 0.5 / 0.9) of held-out prompts of 48 tokens, 32 new tokens each
//!    (greedy, end of sequence ignored): tokens decoded per denoising step, exact match with the
//!    true continuation, and how many generated tokens FP8 changes against f32.
//!
//! Usage:
//!
//! ```text
//! cargo run --release --example quality_fp8 -- [--ouro assets/tiny-ouro] [--sdar assets/tiny-sdar]
//!     [--heldout corpus/heldout.txt] [--sequences 32] [--windows 96] [--prompts 64]
//!     [--write docs/QUALITY.md] [--json docs/bench/quality_fp8.json]
//! ```
//!
//! `--write FILE` replaces the part of FILE between `<!-- quality:fp8:begin -->` and
//! `<!-- quality:fp8:end -->` (appended when FILE has no markers).

use ponder::diffusion::Threshold;
use ponder::looped::gate::{ExitGate, FixedDepth, QExit};
use ponder::ops::{Fp8Kernels, KernelPolicy};
use ponder::quant::Quantization;
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind, SchedulerKind};
use std::time::Instant;

#[path = "shared/masked.rs"]
mod masked;
use masked::{masked_token_stats, RATIOS, SEQ};
#[path = "shared/report.rs"]
mod report;
use report::{shown, splice};
#[path = "shared/heldout.rs"]
mod heldout;
use heldout::{evenly_spaced_windows, read_heldout};

const PROMPT: usize = 32;
const SCORED: usize = 96;
const SDAR_PROMPT: usize = 48;
const SDAR_NEW: usize = 32;
const BEGIN: &str = "<!-- quality:fp8:begin -->";
const END: &str = "<!-- quality:fp8:end -->";

type Failure = Box<dyn std::error::Error>;

/// The three ways a row is computed: f32, FP8 weights, FP8 weights and activations.
const VARIANTS: [(Quantization, Fp8Kernels); 3] =
    [(Quantization::None, Fp8Kernels::Dequantize), (Quantization::Fp8, Fp8Kernels::Dequantize), (Quantization::Fp8, Fp8Kernels::W8A8)];

fn policy(fp8: Fp8Kernels) -> KernelPolicy {
    KernelPolicy { fp8, ..Default::default() }
}

/// Held-out perplexity of the forced tokens and the realised mean depth of one configuration.
fn ouro_row(
    model: &str,
    (q, fp8): (Quantization, Fp8Kernels),
    gate: Box<dyn ExitGate>,
    layout: KvLayoutKind,
    windows: &[&[u32]],
    steps: usize,
) -> Result<(f64, f64), Failure> {
    let width = 8;
    let mut engine = EngineBuilder::new(model)
        .quantization(q)
        .kernels(policy(fp8))
        .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(layout).exit_gate_boxed(gate))
        .max_num_seqs(width)
        .kv_capacity_tokens(width * (PROMPT + SCORED + 16) * steps)
        .build()?;
    for w in windows {
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
    Ok(((nll / count as f64).exp(), engine.metrics().looped().ok_or("a looped model")?.mean_depth()))
}

/// Threshold decoding of `prompts`: the generated tokens and tokens decoded per step.
fn sdar_run(model: &str, (q, fp8): (Quantization, Fp8Kernels), tau: f32, prompts: &[&[u32]]) -> Result<(Vec<Vec<u32>>, f64), Failure> {
    let mut engine = EngineBuilder::new(model)
        .quantization(q)
        .kernels(policy(fp8))
        .diffusion(|o| o.unmask_policy(Threshold::new(tau).expect("a valid threshold")))
        .max_num_seqs(16)
        .build()?;
    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(SDAR_NEW) };
    let outs = engine.generate(prompts.iter().map(|p| p[..SDAR_PROMPT].to_vec()), &params)?;
    let tokens = outs.into_iter().map(|o| o.map(|o| o.token_ids)).collect::<ponder::Result<Vec<_>>>()?;
    let m = engine.metrics();
    let steps = m.denoise().ok_or("a diffusion model")?.steps;
    Ok((tokens, m.generated_tokens as f64 / steps.max(1) as f64))
}

fn main() -> Result<(), Failure> {
    let root = env!("CARGO_MANIFEST_DIR");
    let (mut ouro, mut sdar, mut heldout) = (format!("{root}/assets/tiny-ouro"), format!("{root}/assets/tiny-sdar"), format!("{root}/corpus/heldout.txt"));
    let (mut sequences, mut n_windows, mut n_prompts, mut write, mut json) = (32usize, 96usize, 64usize, None::<String>, None::<String>);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut v = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--ouro" => ouro = v()?,
            "--sdar" => sdar = v()?,
            "--heldout" => heldout = v()?,
            "--sequences" => sequences = v()?.parse()?,
            "--windows" => n_windows = v()?.parse()?,
            "--prompts" => n_prompts = v()?.parse()?,
            "--write" => write = Some(v()?),
            "--json" => json = Some(v()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let held = read_heldout(&heldout)?;
    let started = Instant::now();

    // 1. Tiny Ouro: perplexity and mean depth, f32 against FP8.
    let probe = EngineBuilder::new(&ouro).build()?;
    let ids = probe.encode(&held)?;
    let steps = probe.spec().looped().ok_or("--ouro needs a looped model")?.max_steps;
    drop(probe);
    let (windows, _, total_windows) = evenly_spaced_windows(&ids, PROMPT + SCORED, sequences);
    type Make = Box<dyn Fn() -> ponder::Result<Box<dyn ExitGate>>>;
    let mut configs: Vec<(String, KvLayoutKind, Make)> =
        vec![("full depth".into(), KvLayoutKind::DepthIndexed, Box::new(move || Ok(Box::new(FixedDepth::new(steps)?))))];
    for d in 1..=steps {
        configs.push((format!("fixed depth {d}"), KvLayoutKind::LastExited, Box::new(move || Ok(Box::new(FixedDepth::new(d)?)))));
    }
    for q in [0.2f32, 0.5, 0.8] {
        configs.push((format!("q-exit, q = {q}"), KvLayoutKind::LastExited, Box::new(move || Ok(Box::new(QExit::new(q, 1, steps)?)))));
    }
    let mut ouro_rows = Vec::new();
    for (label, layout, make) in &configs {
        let mut r = Vec::new();
        for v in VARIANTS {
            r.push(ouro_row(&ouro, v, make()?, *layout, &windows, steps)?);
        }
        let [(p32, d32), (p8, d8), (pa, da)] = [r[0], r[1], r[2]];
        println!(
            "{label:>18}: perplexity {p32:.3} f32, {p8:.3} FP8 ({:+.2} %), {pa:.3} W8A8 ({:+.2} %); mean depth {d32:.2} / {d8:.2} / {da:.2}",
            100.0 * (p8 / p32 - 1.0),
            100.0 * (pa / p32 - 1.0)
        );
        ouro_rows.push(serde_json::json!({"config": label, "perplexity_f32": p32, "perplexity_fp8": p8, "perplexity_w8a8": pa, "mean_depth_f32": d32, "mean_depth_fp8": d8, "mean_depth_w8a8": da}));
    }

    // 2. Tiny SDAR: masked-token prediction through the model, then threshold decoding.
    let probe = EngineBuilder::new(&sdar).build()?;
    let sdar_ids = probe.encode(&held)?;
    drop(probe);
    let (mask_windows, _, total_mask_windows) = evenly_spaced_windows(&sdar_ids, SEQ, n_windows);
    let dir = ponder::loader::ModelDir::open(&sdar)?;
    let mut masked_rows = Vec::new();
    let mut stats = Vec::new();
    for (q, fp8) in VARIANTS {
        let model = ponder::diffusion::models::load(&dir.config, &dir.weights(ponder::DType::F32, &ponder::Device::Cpu)?.with_quantization(q))?;
        // The model runs outside an engine here: the policy is set around the run.
        stats.push(ponder::ops::with_kernels(policy(fp8), || masked_token_stats(&model, &mask_windows, 2026, || {})).0?);
    }
    let (s32, s8, sa) = (&stats[0], &stats[1], &stats[2]);
    for (((r, a), b), c) in RATIOS.iter().zip(s32).zip(s8).zip(sa) {
        let acc = |s: &masked::MaskedStats| s.correct as f64 / s.count as f64;
        let ppl = |s: &masked::MaskedStats| (s.nll / s.count as f64).exp();
        println!(
            "mask ratio {r}: accuracy {:.2} % f32, {:.2} % FP8, {:.2} % W8A8; perplexity {:.3} / {:.3} / {:.3}",
            100.0 * acc(a),
            100.0 * acc(b),
            100.0 * acc(c),
            ppl(a),
            ppl(b),
            ppl(c)
        );
        masked_rows.push(serde_json::json!({"ratio": r, "masked_tokens": a.count, "accuracy_f32": acc(a), "accuracy_fp8": acc(b), "accuracy_w8a8": acc(c), "perplexity_f32": ppl(a), "perplexity_fp8": ppl(b), "perplexity_w8a8": ppl(c)}));
    }
    // Windows without an end-of-document token (id 0), evenly spaced.
    let candidates: Vec<&[u32]> = sdar_ids.chunks_exact(SDAR_PROMPT + SDAR_NEW).filter(|w| !w.contains(&0)).collect();
    let n = n_prompts.min(candidates.len());
    let prompts: Vec<&[u32]> = (0..n).map(|i| candidates[i * candidates.len() / n]).collect();
    let mut sdar_rows = Vec::new();
    for tau in [0.5f32, 0.9] {
        let mut runs = Vec::new();
        for v in VARIANTS {
            runs.push(sdar_run(&sdar, v, tau, &prompts)?);
        }
        let [(t32, s32), (t8, s8), (ta, sa)] = [&runs[0], &runs[1], &runs[2]].map(|(t, s)| (t, *s));
        let exact = |t: &[Vec<u32>]| {
            let hits: usize = t.iter().zip(&prompts).map(|(g, w)| g.iter().zip(&w[SDAR_PROMPT..]).filter(|(a, b)| a == b).count()).sum();
            hits as f64 / (prompts.len() * SDAR_NEW) as f64
        };
        let changed = |t: &[Vec<u32>]| {
            t32.iter().zip(t).map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count()).sum::<usize>() as f64 / (prompts.len() * SDAR_NEW) as f64
        };
        let (e32, e8, ea) = (exact(t32), exact(t8), exact(ta));
        let (c8, ca) = (changed(t8), changed(ta));
        println!(
            "τ {tau}: tokens per step {s32:.2} f32, {s8:.2} FP8, {sa:.2} W8A8; exact match {:.1} % / {:.1} % / {:.1} %; FP8 changes {:.1} % of the tokens, W8A8 {:.1} %",
            100.0 * e32,
            100.0 * e8,
            100.0 * ea,
            100.0 * c8,
            100.0 * ca
        );
        sdar_rows.push(serde_json::json!({"tau": tau, "tokens_per_step_f32": s32, "tokens_per_step_fp8": s8, "tokens_per_step_w8a8": sa, "exact_match_f32": e32, "exact_match_fp8": e8, "exact_match_w8a8": ea, "changed_by_fp8": c8, "changed_by_w8a8": ca}));
    }
    let total = started.elapsed().as_secs_f64();
    println!("done in {total:.0} s");

    let (shown_ouro, shown_sdar, shown_heldout) = (shown(&ouro, root), shown(&sdar, root), shown(&heldout, root));
    if let Some(path) = &json {
        let doc = serde_json::json!({
            "ouro": shown_ouro, "sdar": shown_sdar, "heldout": shown_heldout, "device": "cpu", "dtype": "f32",
            "quantization": "fp8 e4m3, per output channel, quantized at load; w8a8 adds per-token e4m3 activations at every launch",
            "ouro_windows": windows.len(), "ouro_windows_total": total_windows, "prompt_tokens": PROMPT, "scored_tokens": SCORED,
            "sdar_prompts": prompts.len(), "sdar_prompt_tokens": SDAR_PROMPT, "sdar_new_tokens": SDAR_NEW,
            "sdar_masked_windows": mask_windows.len(), "sdar_masked_windows_total": total_mask_windows, "sdar_window_tokens": SEQ,
            "total_seconds": total, "ouro_results": ouro_rows, "sdar_masked": masked_rows, "sdar_results": sdar_rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        println!("wrote {path}");
    }
    if let Some(path) = &write {
        let mut md = format!(
            "Produced by `cargo run --release --example quality_fp8 -- --write docs/QUALITY.md --json docs/bench/quality_fp8.json` \
             (CPU; {total:.0} s on the 2-core development machine). f32 is the checkpoint as trained. FP8 quantizes the attention \
             projections and MLPs to E4M3 with one scale per output channel at load and multiplies by the dequantized weights in f32 \
             (the weight-only kernel's numerics, what decode launches of up to 16 rows run on the GPU). W8A8 quantizes the \
             activations of those layers too, E4M3 with one scale per token (the FP8 GEMM's numerics, what launches of more rows \
             run under `fp8=by-shape`), here at every launch: the most FP8 can cost.\n\n\
             **Tiny Ouro** (`{shown_ouro}`): held-out perplexity over {} windows of {PROMPT} prompt + {SCORED} teacher-forced tokens \
             of `{shown_heldout}`, continuous depth batching with refill.\n\n\
             | configuration | perplexity, f32 | FP8 | change | W8A8 | change | mean depth, f32 / FP8 / W8A8 |\n|---|---:|---:|---:|---:|---:|---|\n",
            windows.len()
        );
        for r in &ouro_rows {
            let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            let (a, b, c) = (f("perplexity_f32"), f("perplexity_fp8"), f("perplexity_w8a8"));
            md += &format!(
                "| {} | {a:.3} | {b:.3} | {:+.2} % | {c:.3} | {:+.2} % | {:.2} / {:.2} / {:.2} |\n",
                r["config"].as_str().unwrap_or(""),
                100.0 * (b / a - 1.0),
                100.0 * (c / a - 1.0),
                f("mean_depth_f32"),
                f("mean_depth_fp8"),
                f("mean_depth_w8a8")
            );
        }
        md += &format!(
            "\n**Tiny SDAR** (`{shown_sdar}`), masked-token prediction: {} held-out windows of {SEQ} tokens (evenly spaced, of {total_mask_windows}); \
             each block masked at the ratio with the earlier blocks clean, the masked tokens scored.\n\n\
             | mask ratio | masked tokens | accuracy, f32 / FP8 / W8A8 | perplexity, f32 / FP8 / W8A8 |\n|---|---:|---|---|\n",
            mask_windows.len()
        );
        for r in &masked_rows {
            let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            md += &format!(
                "| {} | {} | {:.2} % / {:.2} % / {:.2} % | {:.3} / {:.3} / {:.3} |\n",
                f("ratio"),
                r["masked_tokens"],
                100.0 * f("accuracy_f32"),
                100.0 * f("accuracy_fp8"),
                100.0 * f("accuracy_w8a8"),
                f("perplexity_f32"),
                f("perplexity_fp8"),
                f("perplexity_w8a8")
            );
        }
        md += &format!(
            "\nThreshold decoding of {} held-out prompts of {SDAR_PROMPT} tokens, {SDAR_NEW} new tokens \
             each (greedy, end of sequence ignored).\n\n\
             | τ | tokens per step, f32 / FP8 / W8A8 | exact match with the held-out text, f32 / FP8 / W8A8 | tokens changed, FP8 / W8A8 |\n|---|---|---|---|\n",
            prompts.len()
        );
        for r in &sdar_rows {
            let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            md += &format!(
                "| {} | {:.2} / {:.2} / {:.2} | {:.1} % / {:.1} % / {:.1} % | {:.1} % / {:.1} % |\n",
                // τ is an f32 in the JSON: shown as set.
                (f("tau") * 100.0).round() / 100.0,
                f("tokens_per_step_f32"),
                f("tokens_per_step_fp8"),
                f("tokens_per_step_w8a8"),
                100.0 * f("exact_match_f32"),
                100.0 * f("exact_match_fp8"),
                100.0 * f("exact_match_w8a8"),
                100.0 * f("changed_by_fp8"),
                100.0 * f("changed_by_w8a8")
            );
        }
        splice(path, BEGIN, END, &md)?;
        println!("wrote {path}");
    }
    Ok(())
}
