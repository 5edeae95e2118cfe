//! The public engine: requests in, streamed tokens out.

mod builder;
mod core;
mod detok;
mod diffusion_runner;
mod family;
mod graphs;
mod handle;
mod latency;
mod launch_check;
mod metrics;
mod options;
mod readback;
mod roofline;
mod runner;

pub use crate::request::{Event, FinishReason, GenerationParams, Output, Prompt, RequestId};
pub use builder::{Checkpoint, EngineBuilder, InMemoryDiffusion, InMemoryLooped, MAX_RESIDENT};
pub use core::Engine;
pub use handle::{EngineHandle, RequestStream};
pub use metrics::{DenoiseStats, DeviceSpan, EngineMetrics, KvPoolStats, LatencyHistogram, StageStats};
pub use options::{DiffusionOptions, DiffusionSchedulerContext, LoopedOptions, SchedulerContext, SchedulerKind};
pub use roofline::{looped_launch_cost, LaunchCost};

pub(crate) use diffusion_runner::DiffusionRunner;
pub(crate) use runner::LoopedRunner;

/// The runners and CUDA-graph helper, for the device tests and benchmarks that drive a model
/// directly (feature `testing`).
#[cfg(feature = "testing")]
pub mod internals {
    pub use super::diffusion_runner::{greedy_readout, greedy_with_confidence, DenoiseForward, DiffusionRunner, PhaseTimes};
    pub use super::graphs::Graph;
    pub use super::runner::{Forward, LoopedRunner, Pending};
}
