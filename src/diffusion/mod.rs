//! Block-diffusion decoding as host-side state machines: which masked tokens to reveal each step
//! (the [`UnmaskPolicy`]) and which block positions a step recomputes (the delayed cache in
//! [`BlockCanvas`]). The diffusion scheduler drives them; nothing here touches tensors.

mod canvas;
mod unmask;

pub use canvas::BlockCanvas;
pub use unmask::{by_confidence, Candidate, Replay, StaticCount, StepContext, Threshold, UnmaskPolicy, UnmaskTrace};
