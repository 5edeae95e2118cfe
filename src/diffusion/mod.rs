//! Block-diffusion decoding as host-side state machines: which masked tokens to reveal each step
//! (the [`UnmaskPolicy`]), which block positions a step recomputes (the delayed cache in
//! [`BlockCanvas`]) and which masked tokens run past layer 1 (the [`EvictionPolicy`], FOCUS).
//! The scheduler drives the first two on the host; the runner applies eviction mid-forward.

mod attention;
mod canvas;
mod eviction;
mod unmask;

pub use attention::{CanvasCache, DiffusionAttention};
pub use canvas::BlockCanvas;
pub use eviction::{enforce_rules, EvictionInput, EvictionPolicy, Focus, NoEviction};
pub use unmask::{by_confidence, Candidate, Confidence, LinearSchedule, Replay, StaticCount, StepContext, Threshold, Timesteps, UnmaskPolicy, UnmaskTrace};
