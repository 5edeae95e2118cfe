//! The public engine: requests in, streamed tokens out.

mod builder;
mod core;
mod detok;
mod diffusion_runner;
mod graphs;
mod handle;
mod metrics;
mod readback;
mod request;
mod runner;

pub use builder::{DiffusionSchedulerContext, EngineBuilder, SchedulerContext, SchedulerKind};
pub use core::Engine;
pub use handle::{EngineHandle, RequestStream};
pub use diffusion_runner::{greedy_readout, greedy_with_confidence, DenoiseForward, DiffusionRunner, PhaseTimes};
pub use metrics::{DenoiseStats, EngineMetrics, StageStats};
pub use request::{Event, FinishReason, GenerationParams, Output, Prompt, RequestId};
pub use graphs::Graph;
pub use runner::{Forward, LoopedRunner, Pending};
