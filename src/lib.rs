//! # Ponder
//!
//! A serving engine for language models that decide per token how much to compute, on candle
//! tensors, on the CPU and on CUDA GPUs.
//!
//! - **Looped LMs** (Ouro, Huginn): a shared core runs up to `r_max` times per token. Served
//!   with continuous depth batching — scheduling at the granularity of one loop iteration, rows
//!   at different loop steps in one launch, freed rows refilled as tokens exit — under
//!   swappable exit gates and KV layouts, or with full-depth continuous batching (the baseline).
//! - **Diffusion LMs** (SDAR, LLaDA, Dream): a block of masked tokens is denoised over several
//!   steps, requests batched continuously; unmasking policies decide what a step reveals, the
//!   delayed cache recomputes only what changed, and FOCUS eviction runs the layers after the
//!   first two only on the tokens likely to be revealed this step.
//!
//! ## Quick start
//! ```no_run
//! use ponder::{EngineBuilder, GenerationParams};
//! let mut engine = EngineBuilder::new("assets/tiny-ouro").build()?;
//! let outs = engine.generate(["The borrow checker"], &GenerationParams::greedy(32))?;
//! for out in outs {
//!     println!("{}", out?.text);
//! }
//! # Ok::<(), ponder::Error>(())
//! ```
//! Options of one family go in its own type; a diffusion checkpoint gets the block-diffusion
//! scheduler:
//! ```no_run
//! use ponder::diffusion::{Focus, Threshold};
//! use ponder::{EngineBuilder, GenerationParams};
//! let (threshold, focus) = (Threshold::new(0.9)?, Focus::new(1.5)?);
//! let mut engine = EngineBuilder::new("assets/tiny-sdar")
//!     .diffusion(|o| o.delayed_cache(true).unmask_policy(threshold).eviction_policy(focus))
//!     .build()?;
//! let out = engine.generate(["fn main() {"], &GenerationParams::greedy(32))?.remove(0)?;
//! println!("{}", out.text);
//! # Ok::<(), ponder::Error>(())
//! ```
//!
//! ## Capabilities
//! | capability | entry point | example |
//! |---|---|---|
//! | generate in-process, step by step | [`Engine::add_request`], [`Engine::step`] | `examples/generate.rs` |
//! | stream from many threads | [`EngineBuilder::spawn`], [`EngineHandle::submit`] | `examples/generate.rs` |
//! | depth-adaptive serving | [`SchedulerKind::Depth`], [`LoopedOptions::exit_gate`], [`KvLayoutKind`] | `examples/bench_looped/` |
//! | overlap host work with the device | [`LoopedOptions::overlap`] | `examples/bench_looped/ --overlap on` |
//! | score text (teacher forcing) | [`GenerationParams::forced_tokens`] | `examples/quality.rs` |
//! | your own exit gate | [`looped::gate::ExitGate`] | `examples/custom_gate.rs` |
//! | your own scheduler | [`looped::LoopedScheduler`], [`LoopedOptions::custom_scheduler`] | `examples/custom_scheduler.rs` |
//! | your own KV layout | [`looped::layout::KvLayout`], [`LoopedOptions::custom_kv_layout`] | `src/looped/layout.rs` |
//! | measure your own component on the benchmark workload | `bench::workload`, `bench::offline` (feature `testing`) | `examples/bench_looped/` |
//! | block diffusion, unmasking policies | [`diffusion::UnmaskPolicy`], [`DiffusionOptions::unmask_policy`], [`DiffusionOptions::delayed_cache`] | `examples/generate.rs --sdar` |
//! | LLaDA / Dream as their references decode them, or with Fast-dLLM's caches | [`diffusion::CanvasCache`], [`DiffusionOptions::canvas_cache`], [`diffusion::LinearSchedule`], [`DiffusionOptions::dream_sampler`] | `examples/generate.rs --llada`, `examples/quality_bidirectional.rs` |
//! | long prompts next to decoding requests, KV sized to the device | [`EngineBuilder::max_num_batched_tokens`], [`EngineBuilder::kv_memory_fraction`] | `examples/bench_looped/ --long-prompts` |
//! | FOCUS eviction | [`diffusion::Focus`], [`DiffusionOptions::eviction_policy`] | `examples/bench_diffusion.rs`, `examples/quality_diffusion.rs` |
//! | your own diffusion scheduler | [`diffusion::DiffusionScheduler`], [`DiffusionOptions::custom_scheduler`] | `examples/custom_diffusion_scheduler.rs` |
//! | GPU throughput | `--features cuda` | `examples/bench_looped/`, `examples/bench_diffusion.rs`, `docs/GPU.md` |
//! | a model over several GPUs (tensor, expert parallelism) | [`EngineBuilder::tensor_parallel`], [`EngineBuilder::tensor_parallel_on`], [`EngineBuilder::expert_parallel`] | `examples/generate.rs --tp 2`, `examples/bench_parallel.rs` |
//!
//! Architecture and invariants: `docs/ARCHITECTURE.md`.

// Validation writes `!(x > 0.0)` on purpose: NaN must be refused as well.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

#[cfg(any(test, feature = "testing"))]
pub mod bench;
pub mod chat;
pub mod config;
pub mod diffusion;
mod dist;
pub mod engine;
pub mod error;
/// Which kernels an engine's launches run ([`EngineBuilder::kernels`]; the defaults are the
/// fastest measured) and how many dispatches each choice took ([`EngineMetrics::kernels`]).
pub mod kernels {
    pub use crate::ops::policy::{AttentionKernels, DecodeRing, KernelCounts, KernelPolicy, MoeKernels, SimtDeep, SplitK};
}
pub mod kv;
pub mod loader;
pub mod looped;
/// Tensor ops and CUDA kernels with their CPU references (public with feature `testing`, for
/// the device tests and benchmarks).
#[cfg(feature = "testing")]
pub mod ops;
#[cfg(not(feature = "testing"))]
mod ops;
pub mod parallel;
pub mod quant;
pub mod request;
/// Sampling on the device: a request's seeded sampler and the batched sampling kernels (public
/// with feature `testing`; an application sets [`SamplingParams`]).
#[cfg(feature = "testing")]
pub mod sampling;
#[cfg(not(feature = "testing"))]
mod sampling;
pub mod scheduler;
/// Random checkpoints in the released layouts, tiny configs, tokenizer training: what the
/// tests and benchmarks build models from (feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;

pub use chat::{Chat, ChatMessage, ChatTemplate};
pub use diffusion::DiffusionOptions;
pub use engine::{
    Engine, EngineBuilder, EngineHandle, EngineMetrics, Event, FinishReason, GenerationParams, ModelInfo, Output, Prompt, RequestId, RequestStream,
    TokenCompute, TokenLogprob, MAX_TOP_LOGPROBS,
};
pub use error::{Error, HubError, InvalidRequest, Result};
pub use looped::{KvLayoutKind, LoopedOptions, SchedulerKind};
pub use sampling::SamplingParams;

/// Re-exported so callers can name devices and dtypes without depending on candle directly.
pub use candle_core::{DType, Device};
