//! The in-process engine a live-load run drives: a checkpoint directory, or a released model's
//! shapes with random bf16 weights generated on the device; the serving mode; and replayed
//! decisions (exit depths, unmask counts), so that random weights do the work a real model
//! would.

use ponder::diffusion::models::{DiffusionModel, Llada2, Llada2Config, Sdar, SdarConfig};
use ponder::looped::gate::{DepthTrace, Replay};
use ponder::looped::models::{Huginn, HuginnConfig, LoopedModel, Ouro, OuroConfig};
use ponder::{DType, Device, EngineBuilder, EngineHandle, KvLayoutKind, SchedulerKind};

type Failure = Box<dyn std::error::Error>;

/// How the engine is set up (`main.rs` parses it from the command line).
#[derive(Debug, Clone)]
pub struct Setup {
    /// `ouro-1.4b`, `huginn-3.5b`, `sdar-8b`, `llada2-mini`: random weights in those shapes.
    pub shapes: Option<String>,
    /// A checkpoint directory, when no `shapes`.
    pub model: String,
    pub cuda: bool,
    /// Most requests decoding together (`max_num_seqs`).
    pub width: usize,
    /// Looped: `cb`, `cdb-refill`, `cdb-no-refill`; diffusion: `baseline`, `baseline-delayed`,
    /// `focus`.
    pub mode: String,
    /// Depth batching's KV layout (default last-exited: every token readable after any exit).
    pub layout: Option<String>,
    /// Seeded exit depths: mean and floor (defaults: Ouro 2.5 over 1..=4, Huginn 8 over 2..=16).
    pub mean_depth: Option<f64>,
    pub min_depth: Option<usize>,
    /// Recorded exit depths (`quality_gates --traces`), instead of the seeded ones.
    pub depth_trace: Option<String>,
    /// Issue each depth-batching launch before reading the last one's exits (default on: the
    /// replayed depths are known a step ahead, as the lookahead gate's are).
    pub overlap: Option<bool>,
    /// Huginn's coda: hold it for this many exited tokens (default W) with W − 1 requests parked
    /// beyond W (`coda_reserve`), the settings that serve it best offline.
    pub min_coda: Option<usize>,
    /// Diffusion: block length, the realised tokens revealed per step, FOCUS's α.
    pub block: usize,
    pub mean_unmask: f64,
    pub alpha: f32,
    /// FOCUS's load-aware budget: launches of fewer tokens keep more (`Focus::with_knee`; 0 off).
    pub focus_knee: usize,
    /// How the linear layers are stored (`fp8`: E4M3, a scale per output channel).
    pub quantization: ponder::quant::Quantization,
}

/// The engine, what it serves, and its settings as recorded in the JSON.
pub struct InProcess {
    pub handle: EngineHandle,
    pub name: String,
    /// Diffusion models: prompts must not hold the mask token.
    pub mask_token: Option<u32>,
    pub settings: serde_json::Value,
}

enum Family {
    Looped,
    Diffusion,
}

fn family_of_mode(mode: &str) -> Result<Family, Failure> {
    match mode {
        "cb" | "cdb-refill" | "cdb-no-refill" => Ok(Family::Looped),
        "baseline" | "baseline-delayed" | "focus" => Ok(Family::Diffusion),
        other => Err(format!("--mode {other}: cb | cdb-refill | cdb-no-refill (looped) or baseline | baseline-delayed | focus (diffusion)").into()),
    }
}

pub fn build(s: &Setup) -> Result<InProcess, Failure> {
    let device = if s.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    // Released shapes run in bf16 as released; a checkpoint on the CPU in its own f32.
    let dtype = DType::BF16;
    match (s.shapes.as_deref(), family_of_mode(&s.mode)?) {
        (Some("ouro-1.4b"), Family::Looped) => {
            let cfg = OuroConfig::ouro_1_4b();
            let model = Ouro::load(&cfg, &ponder::testing::random_ouro_weights(&cfg, 7, dtype, &device)?.with_quantization(s.quantization))?;
            looped(s, Box::new(model), "Ouro-1.4B shapes, random bf16 weights", false)
        }
        (Some("huginn-3.5b"), Family::Looped) => {
            let cfg = HuginnConfig::huginn_0125();
            let tensors = ponder::testing::random_tensors(&ponder::testing::huginn_tensor_manifest(&cfg), 7, dtype, &device)?;
            let model = Huginn::load(&cfg, &ponder::loader::Weights::from_map(tensors, dtype, &device).with_quantization(s.quantization))?;
            looped(s, Box::new(model), "Huginn-0125 (3.5B) shapes, r_max 16, random bf16 weights", true)
        }
        (Some("sdar-8b"), Family::Diffusion) => {
            let cfg = SdarConfig::sdar_8b_chat_b32();
            let model = Sdar::load(&cfg, &ponder::testing::random_sdar_weights(&cfg, 7, dtype, &device)?.with_quantization(s.quantization))?;
            diffusion(s, Box::new(model), "SDAR-8B-Chat-b32 shapes, random bf16 weights")
        }
        (Some("llada2-mini"), Family::Diffusion) => {
            let cfg = Llada2Config::llada2_mini();
            let model = Llada2::load(&cfg, &ponder::testing::random_llada2_weights(&cfg, 7, dtype, &device)?.with_quantization(s.quantization))?;
            diffusion(s, Box::new(model), "LLaDA2.0-mini shapes, random bf16 weights")
        }
        (Some(shapes @ ("ouro-1.4b" | "huginn-3.5b" | "sdar-8b" | "llada2-mini")), _) => Err(format!("--mode {} does not serve {shapes}", s.mode).into()),
        (Some(other), _) => Err(format!("--shapes {other}: ouro-1.4b | huginn-3.5b | sdar-8b | llada2-mini").into()),
        (None, family) => checkpoint(s, family, device),
    }
}

/// The replayed exit depths and the KV layout depth batching needs; `None` for CB.
fn depth_settings(s: &Setup, max_steps: usize, heavy_coda: bool) -> Result<Option<(Replay, KvLayoutKind, serde_json::Value)>, Failure> {
    if s.mode == "cb" {
        return Ok(None);
    }
    let (trace, min, source) = match &s.depth_trace {
        // Recorded depths are replayed as chosen, a depth-1 exit included.
        Some(file) => (DepthTrace::stream_from_json_file(std::path::Path::new(file), 5)?, 1, serde_json::json!({"trace": file})),
        None => {
            let (mean, min) = match heavy_coda {
                true => (s.mean_depth.unwrap_or(8.0), s.min_depth.unwrap_or(2)),
                false => (s.mean_depth.unwrap_or(2.5), s.min_depth.unwrap_or(1)),
            };
            (DepthTrace::with_mean(mean, min, max_steps, 5)?, min, serde_json::json!({"mean": mean, "min": min, "max": max_steps}))
        }
    };
    let layout: KvLayoutKind = s.layout.as_deref().unwrap_or("last-exited").parse()?;
    Ok(Some((Replay::new(trace, min, max_steps)?, layout, source)))
}

fn looped(s: &Setup, model: Box<dyn LoopedModel>, name: &str, heavy_coda: bool) -> Result<InProcess, Failure> {
    let max_steps = model.spec().max_steps;
    let depth = depth_settings(s, max_steps, heavy_coda)?;
    let b = EngineBuilder::from_model(model, None, vec![]).max_num_seqs(s.width).max_num_batched_tokens(8192);
    let (b, settings) = looped_options(s, depth, heavy_coda, |f| b.looped(f))?;
    Ok(InProcess { handle: b.spawn()?, name: name.into(), mask_token: None, settings })
}

/// Applies the scheduler, replayed gate, layout, overlap and coda settings through `apply`
/// (the builder's `looped`, whichever source it has).
fn looped_options<B>(
    s: &Setup,
    depth: Option<(Replay, KvLayoutKind, serde_json::Value)>,
    heavy_coda: bool,
    apply: impl FnOnce(Box<dyn FnOnce(ponder::LoopedOptions) -> ponder::LoopedOptions>) -> B,
) -> Result<(B, serde_json::Value), Failure> {
    let scheduler: SchedulerKind = s.mode.parse()?;
    let Some((gate, layout, source)) = depth else {
        return Ok((apply(Box::new(move |o| o.scheduler(scheduler))), serde_json::json!({"scheduler": s.mode})));
    };
    let overlap = s.overlap.unwrap_or(true);
    // Huginn's coda runs transformer blocks: batch it (W exited tokens), parking W − 1 more
    // requests so the core launches stay full meanwhile — its best offline setting.
    let (min_coda, reserve) = match (heavy_coda, scheduler) {
        (true, SchedulerKind::Depth { refill: true }) => {
            let m = s.min_coda.unwrap_or(s.width);
            (Some(m), m.saturating_sub(1))
        }
        _ => (s.min_coda, 0),
    };
    let settings = serde_json::json!({
        "scheduler": s.mode, "layout": format!("{layout:?}"), "depths": source, "overlap": overlap,
        "min_coda": min_coda, "coda_reserve": reserve,
    });
    let b = apply(Box::new(move |o| {
        let o = o.scheduler(scheduler).exit_gate(gate).kv_layout(layout).overlap(overlap).coda_reserve(reserve);
        match min_coda {
            Some(m) => o.min_coda_batch_size(m),
            None => o,
        }
    }));
    Ok((b, settings))
}

fn diffusion(s: &Setup, model: Box<dyn DiffusionModel>, name: &str) -> Result<InProcess, Failure> {
    let mask = model.spec().mask_token_id;
    let b = EngineBuilder::from_diffusion_model(model, None, vec![]).max_num_seqs(s.width);
    // A block-causal step row is its block (and, with the delayed cache, at most that again).
    let b = b.max_num_batched_tokens(s.width * (2 * s.block + 1) + 8192).max_model_len(4096);
    let (b, settings) = diffusion_options(s, |f| b.diffusion(f))?;
    Ok(InProcess { handle: b.spawn()?, name: name.into(), mask_token: Some(mask), settings })
}

/// Block length, one denoising step per token at most, the delayed cache, FOCUS, and unmask
/// counts replayed at the realised mean `mean_unmask` (FOCUS reports ≈ 10 % of a 32-block).
fn diffusion_options<B>(
    s: &Setup,
    apply: impl FnOnce(Box<dyn FnOnce(ponder::DiffusionOptions) -> ponder::DiffusionOptions>) -> B,
) -> Result<(B, serde_json::Value), Failure> {
    let trace = ponder::diffusion::UnmaskTrace::with_realised_mean(s.mean_unmask, s.block, 2026)?;
    let delayed = s.mode != "baseline";
    let focus = (s.mode == "focus").then(|| ponder::diffusion::Focus::new(s.alpha).map(|f| f.with_knee(s.focus_knee))).transpose()?;
    let settings = serde_json::json!({
        "mode": s.mode, "block": s.block, "realised_mean_unmask": s.mean_unmask, "trace_mean": trace.expected_mean(),
        "delayed_cache": delayed, "focus_alpha": focus.as_ref().map(|_| s.alpha), "focus_knee": focus.as_ref().map(|f| f.knee),
    });
    let block = s.block;
    let b = apply(Box::new(move |o| {
        let o = o.block_length(block).max_steps_per_block(block).delayed_cache(delayed).unmask_policy(ponder::diffusion::Replay::new(trace));
        match focus {
            Some(f) => o.eviction_policy(f),
            None => o,
        }
    }));
    Ok((b, settings))
}

/// A checkpoint directory: its family decides which options apply.
fn checkpoint(s: &Setup, family: Family, device: Device) -> Result<InProcess, Failure> {
    let dir = ponder::loader::ModelDir::open(&s.model)?;
    let b = EngineBuilder::new(&s.model).device(device).quantization(s.quantization).max_num_seqs(s.width).max_num_batched_tokens(8192);
    let b = if s.cuda { b.dtype(DType::BF16) } else { b };
    let name = s.model.clone();
    match (family, &dir.config) {
        (Family::Looped, ponder::config::ModelConfig::Ouro(c)) => {
            let depth = depth_settings(s, c.total_ut_steps, false)?;
            let (b, settings) = looped_options(s, depth, false, |f| b.looped(f))?;
            Ok(InProcess { handle: b.spawn()?, name, mask_token: None, settings })
        }
        (Family::Looped, ponder::config::ModelConfig::Huginn(c)) => {
            let depth = depth_settings(s, c.max_steps, true)?;
            let (b, settings) = looped_options(s, depth, true, |f| b.looped(f))?;
            Ok(InProcess { handle: b.spawn()?, name, mask_token: None, settings })
        }
        (Family::Diffusion, ponder::config::ModelConfig::Sdar(_) | ponder::config::ModelConfig::Llada2(_)) => {
            let (b, settings) = diffusion_options(s, |f| b.diffusion(f))?;
            let handle = b.spawn()?;
            let mask = handle.model().diffusion().map(|d| d.mask_token_id);
            Ok(InProcess { handle, name, mask_token: mask, settings })
        }
        (_, c) => Err(format!(
            "--mode {} does not serve {} ({}): looped modes take Ouro or Huginn, diffusion modes SDAR or LLaDA2.0",
            s.mode,
            s.model,
            c.model_type()
        )
        .into()),
    }
}
