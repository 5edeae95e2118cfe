//! Diffusion LMs (SDAR, LLaDA, LLaDA2.0, Dream): a block of masked tokens is denoised over
//! several steps.
//!
//! Everything that is the diffusion family's own lives here: its models ([`models`]: a layer
//! split into `project` and `finish_layer`, so tokens can be scored and dropped between the two),
//! its launches ([`DenoiseLaunch`]: prefill, commit and step rows), the block-diffusion scheduler
//! ([`DiffusionBatching`]), the host-side strategies — which masked tokens to reveal each step
//! ([`UnmaskPolicy`]), which block positions a step recomputes (the delayed cache in
//! `BlockCanvas`), which masked tokens run past layer 1 ([`EvictionPolicy`], FOCUS) — its runner
//! and its options ([`DiffusionOptions`]).

mod attention;
pub(crate) mod build;
mod canvas;
mod eviction;
mod executor;
mod half;
mod launch;
mod metrics;
pub mod models;
mod options;
pub(crate) mod runner;
mod sampling;
mod scheduler;
mod unmask;

pub use crate::sampling::FilterOrder;
pub use launch::{DenoiseLaunch, DenoiseResult, DenoiseRow, DenoiseRowOutput, DiffusionScheduler, Emitted, EvictRow};
pub use metrics::DenoiseStats;
pub use options::{DiffusionOptions, DiffusionSchedulerContext};
pub use sampling::{DiffusionSampler, StepDraw};
pub use scheduler::{DiffusionBatching, DiffusionConfig};

pub(crate) use half::DiffusionHalf;

pub use attention::{CanvasCache, DiffusionAttention};
pub(crate) use canvas::BlockCanvas;
pub use eviction::{enforce_rules, EvictionInput, EvictionPolicy, Focus, NoEviction};
pub use unmask::{by_confidence, Candidate, Confidence, LinearSchedule, Replay, StaticCount, StepContext, Threshold, Timesteps, UnmaskPolicy, UnmaskTrace};
