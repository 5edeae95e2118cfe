//! # Ponder
//!
//! A serving engine for language models that decide per token how much to compute, on candle
//! tensors, on the CPU and on CUDA GPUs.
//!
//! - **Looped LMs** (Ouro, Huginn): a shared core runs up to `r_max` times per token. Served
//!   with continuous depth batching — scheduling at the granularity of one loop iteration, rows
//!   at different loop steps in one launch, freed rows refilled as tokens exit — under
//!   swappable exit gates and KV layouts, or with full-depth continuous batching (the baseline).
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
//!
//! ## Capabilities
//! | capability | entry point | example |
//! |---|---|---|
//! | generate in-process, step by step | [`Engine::add_request`], [`Engine::step`] | `examples/generate.rs` |
//! | stream from many threads | [`EngineBuilder::spawn`], [`EngineHandle::submit`] | `examples/generate.rs` |
//! | depth-adaptive serving | [`SchedulerKind::Depth`], [`EngineBuilder::exit_gate`], [`KvLayoutKind`] | `examples/bench_looped/` |
//! | overlap host work with the device | [`EngineBuilder::overlap`] | `examples/bench_looped/ --overlap on` |
//! | score text (teacher forcing) | [`GenerationParams::forced_tokens`] | `examples/quality.rs` |
//! | your own exit gate | [`gate::ExitGate`] | `examples/custom_gate.rs` |
//! | your own scheduler | [`scheduler::Scheduler`], [`EngineBuilder::custom_scheduler`] | `examples/custom_scheduler.rs` |
//! | your own KV layout | [`kv::KvLayout`], [`EngineBuilder::custom_kv_layout`] | `src/kv/layout.rs` |
//! | GPU throughput | `--features cuda` | `examples/bench_looped/`, `docs/GPU.md` |
//!
//! Architecture and invariants: `docs/ARCHITECTURE.md`.

pub mod diffusion;
mod dist;
pub mod engine;
pub mod error;
pub mod gate;
pub mod kv;
pub mod loader;
pub mod models;
pub mod ops;
pub mod sampling;
pub mod scheduler;
pub mod testing;

pub use engine::{
    Engine, EngineBuilder, EngineHandle, EngineMetrics, Event, FinishReason, GenerationParams, Output, Prompt, RequestId, RequestStream, SchedulerKind,
};
pub use error::{Error, InvalidRequest, Result};
pub use kv::KvLayoutKind;
pub use sampling::SamplingParams;

/// Re-exported so callers can name devices and dtypes without depending on candle directly.
pub use candle_core::{DType, Device};
