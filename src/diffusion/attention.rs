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

/// What a denoising step of a bidirectional model (LLaDA, Dream) recomputes. The canvas is the
/// prompt followed by every masked position the request may generate; semi-autoregressive blocks
/// start at the prompt's end. Block-causal models ignore this: their completed blocks are an
/// exact prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CanvasCache {
    /// Every step runs the whole canvas with nothing kept from earlier steps: the model's own
    /// computation, as the references' `generate` does it (the default).
    #[default]
    Exact,
    /// Fast-dLLM's prefix cache: a block's first step runs the whole canvas and keeps the K/V
    /// before the block; its later steps run the block and the masked suffix after it. Saves the
    /// prompt's and earlier blocks' compute on every later step; approximate, because in a
    /// bidirectional model the prefix attends to the block as it changes.
    Prefix,
    /// Fast-dLLM's dual cache: also keeps the masked suffix's K/V from the block's first step;
    /// later steps run only the current block. Saves the suffix too; approximate for the prefix
    /// as above and for the suffix, which no longer sees the block's reveals.
    Dual,
}
