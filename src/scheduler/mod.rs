//! Schedulers decide what runs next; they never touch tensors.
//!
//! The engine core owns the requests — the waiting queue, the admitted set and their KV blocks
//! ([`Requests`]) — and lends them to the scheduler, a policy: it admits, preempts and grows
//! requests through [`Requests`] and returns a launch, plain data naming the rows, their tokens
//! and positions and the block tables to use. The engine runs it and hands back a result of
//! small per-row host values. When a request ends, the core frees its blocks and tells the
//! scheduler to forget it. A scheduler is therefore testable with no model, cannot leak KV, and a
//! researcher can write one in another crate.
//!
//! The two model families schedule different work, so each has its own launch types and
//! scheduler trait, in their families' modules: [`crate::looped::LoopedScheduler`] and
//! [`crate::diffusion::DiffusionScheduler`]; what they share is here.

mod requests;

pub use crate::request::SchedRequest;
pub use requests::Requests;

/// Limits every built-in scheduler honours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Most requests resident (decoding) at once: the decode width W.
    pub max_num_seqs: usize,
    /// Launch budget: most prompt tokens one prefill launch holds (longer prompts are
    /// prefilled in chunks of at most this many). Not a limit on the prompt's length.
    pub max_num_batched_tokens: usize,
}

impl Default for SchedulerLimits {
    fn default() -> Self {
        Self { max_num_seqs: 64, max_num_batched_tokens: 8192 }
    }
}
