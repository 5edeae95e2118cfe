//! Looped LMs (Ouro, Huginn): a shared core runs up to `r_max` times per token.
//!
//! Everything that is the looped family's own lives here: its models ([`models`]: prelude → core
//! step × r → coda), its launches ([`LoopedLaunch`]: rows at different loop steps in one launch),
//! its schedulers (full-depth [`ContinuousBatching`], [`DepthBatching`] — continuous depth
//! batching with refill and overlap), the exit gates that decide when a token leaves the loop
//! ([`gate`]), the KV layouts that map loop steps to cache slots ([`layout`]), its runner (the
//! state bank, CUDA graphs, asynchronous read-back) and its options ([`LoopedOptions`]).

mod admission;
pub(crate) mod build;
mod continuous;
mod depth;
#[cfg(test)]
mod driven;
mod executor;
pub mod gate;
mod half;
mod launch;
pub mod layout;
mod metrics;
pub mod models;
mod options;
mod roofline;
pub(crate) mod runner;

pub use continuous::ContinuousBatching;
pub use depth::{DepthBatching, DepthConfig};
pub use launch::{KvCopy, LoopedLaunch, LoopedResult, LoopedRow, LoopedRowOutput, LoopedScheduler, Stage};
pub use layout::KvLayoutKind;
pub use metrics::{GraphNodes, GraphStats, LoopedMetrics};
pub use options::{LoopedOptions, SchedulerContext, SchedulerKind};

pub(crate) use half::LoopedHalf;
