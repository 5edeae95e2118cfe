//! The public engine: requests in, streamed tokens out.

mod builder;
mod core;
mod detok;
mod diffusion_runner;
mod graphs;
mod handle;
mod launch_check;
mod metrics;
mod readback;
mod request;
mod runner;

pub use builder::{DiffusionSchedulerContext, EngineBuilder, SchedulerContext, SchedulerKind};
pub use core::Engine;
pub use diffusion_runner::{greedy_readout, greedy_with_confidence, DenoiseForward, DiffusionRunner, PhaseTimes};
pub use graphs::Graph;
pub use handle::{EngineHandle, RequestStream};
pub use metrics::{DenoiseStats, DeviceSpan, EngineMetrics, StageStats};
pub use request::{Event, FinishReason, GenerationParams, Output, Prompt, RequestId};
pub use runner::{Forward, LoopedRunner, Pending};
