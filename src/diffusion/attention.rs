//! How a diffusion model's tokens attend: what the scheduler needs to know of the model to
//! decide which positions a step recomputes and which K/V stay exact.

/// How a diffusion model's tokens attend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiffusionAttention {
    /// A token sees every token of its own block and of earlier blocks (SDAR): earlier blocks'
    /// K/V are exact once written, so completed blocks are a prefix cache.
    BlockCausal,
    /// Every token sees the whole canvas (LLaDA, Dream): a cached prefix is an approximation,
    /// refreshed at each block start.
    Bidirectional,
}
