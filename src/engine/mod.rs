//! The public engine: requests in, streamed tokens out.

mod builder;
mod core;
mod detok;
mod family;
mod handle;
mod latency;
pub(crate) mod launch_check;
mod live;
mod metrics;

pub use crate::request::{Event, FinishReason, GenerationParams, Output, Prompt, RequestId, TokenCompute, TokenLogprob, MAX_TOP_LOGPROBS};
pub(crate) use builder::Common;
pub use builder::{Checkpoint, EngineBuilder, InMemoryDiffusion, InMemoryLooped};
pub(crate) use core::Family;
pub use core::{Engine, ModelInfo, ModelSpec, OwnedModelSpec};
pub use handle::{EngineHandle, RequestStream};
pub(crate) use metrics::DeviceSpan;
pub use metrics::{EngineMetrics, FamilyMetrics, KvPoolStats, LatencyHistogram, LaunchCost, StageStats};

pub(crate) use family::{Completed, Half, Issued};
pub(crate) use live::Live;

/// The runners and CUDA-graph helper, for the device tests and benchmarks that drive a model
/// directly (feature `testing`).
#[cfg(feature = "testing")]
pub mod internals {
    pub use crate::diffusion::runner::{greedy_readout, greedy_with_confidence, DenoiseForward, DiffusionRunner, PhaseTimes};
    pub use crate::looped::runner::graphs::{GemmWorkspace, Graph};
    pub use crate::looped::runner::{Forward, LoopedRunner, Pending};
}
