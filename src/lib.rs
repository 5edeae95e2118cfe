//! # Ponder
//!
//! A serving engine for language models that decide per token how much to compute, on candle
//! tensors, on the CPU and on CUDA GPUs.
//!
//! - **Looped LMs** (Ouro): a shared core runs up to `r_max` times per token. Served today with
//!   full-depth continuous batching over a paged, depth-aware KV cache; continuous depth
//!   batching (per-iteration scheduling with exit gates) builds on the same traits.
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
//! | your own scheduler | [`scheduler::Scheduler`], [`EngineBuilder::custom_scheduler`] | `tests/custom_scheduler.rs` |
//! | your own KV layout | [`kv::KvLayout`], [`EngineBuilder::custom_kv_layout`] | `src/kv/layout.rs` |
//! | GPU throughput | `--features cuda` | `examples/bench_looped.rs` |
//!
//! Architecture and invariants: `docs/ARCHITECTURE.md`.

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
    Engine, EngineBuilder, EngineHandle, EngineMetrics, Event, FinishReason, GenerationParams, Output, Prompt,
    RequestId, RequestStream, SchedulerKind,
};
pub use error::{Error, InvalidRequest, Result};
pub use kv::KvLayoutKind;
pub use sampling::SamplingParams;

/// Re-exported so callers can name devices and dtypes without depending on candle directly.
pub use candle_core::{DType, Device};
