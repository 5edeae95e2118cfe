//! KV layouts: which cache slot a loop step reads and writes.

/// Maps loop steps of a looped model to cache slots. A layout is a pure mapping; the pool owns
/// memory and the scheduler asks the layout where each row's step lives.
pub trait KvLayout: std::fmt::Debug + Send + Sync {
    /// Short name used in metrics and benchmark output.
    fn name(&self) -> &'static str;
    /// Number of slots a request needs when the model loops at most `max_steps` times.
    fn num_slots(&self, max_steps: usize) -> usize;
    /// Slot of 0-based loop step `step`.
    fn slot_for_step(&self, step: usize) -> usize;
}

/// Slot = loop step: every step has its own K/V (the layout Ouro was trained with; r_max× memory).
#[derive(Debug, Clone, Copy, Default)]
pub struct DepthIndexed;

/// One slot per physical layer: every step overwrites the same K/V, so later tokens read each
/// earlier token's most recent (exit-step) K/V. 1/r_max of depth-indexed memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shared;

impl KvLayout for DepthIndexed {
    fn name(&self) -> &'static str {
        "depth-indexed"
    }
    fn num_slots(&self, max_steps: usize) -> usize {
        max_steps
    }
    fn slot_for_step(&self, step: usize) -> usize {
        step
    }
}

impl KvLayout for Shared {
    fn name(&self) -> &'static str {
        "shared"
    }
    fn num_slots(&self, _max_steps: usize) -> usize {
        1
    }
    fn slot_for_step(&self, _step: usize) -> usize {
        0
    }
}

/// The built-in layouts by name, for builders and command lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvLayoutKind {
    #[default]
    DepthIndexed,
    Shared,
}

impl KvLayoutKind {
    pub fn build(self) -> Box<dyn KvLayout> {
        match self {
            Self::DepthIndexed => Box::new(DepthIndexed),
            Self::Shared => Box::new(Shared),
        }
    }
}

impl std::str::FromStr for KvLayoutKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "depth-indexed" | "depth_indexed" => Ok(Self::DepthIndexed),
            "shared" | "single" => Ok(Self::Shared),
            other => Err(crate::Error::InvalidOption(format!("unknown KV layout `{other}`"))),
        }
    }
}
