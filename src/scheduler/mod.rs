//! Schedulers decide what runs next; they never touch tensors.
//!
//! A scheduler holds request state and KV bookkeeping and returns a launch: plain data naming
//! the rows, their tokens and positions and the block tables to use. The engine runs it and
//! hands back a result of small per-row host values. A scheduler is therefore testable with no
//! model, and a researcher can write one in another crate.
//!
//! The two model families schedule different work, so each has its own launch types and trait
//! over the common part here ([`Scheduler`]): [`crate::looped::LoopedScheduler`] and
//! [`crate::diffusion::DiffusionScheduler`], in their families' modules.

mod queue;

pub use queue::Requests;

use crate::kv::KvManager;
use crate::request::RequestId;
pub use crate::request::SchedRequest;

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

impl SchedulerLimits {
    /// The full-depth prefill admission rule both looped schedulers share: while requests are
    /// decoding, admit only once `min_free_slots` resident slots are free (or every waiting
    /// request fits), so one prefill launch takes many prompts. `None`: `max(1, max_num_seqs / 16)`.
    pub fn admits_prefill(&self, min_free_slots: Option<usize>, decoding: bool, free_slots: usize, waiting: usize) -> bool {
        let min_free = min_free_slots.unwrap_or((self.max_num_seqs / 16).max(1));
        !decoding || free_slots >= min_free.min(waiting)
    }
}

/// Whether prompts must be prefilled whole: a layout with fewer cache slots than loop steps makes
/// steps share a slot, and then a chunk boundary changes the function (see [`prefill_chunk`]).
pub fn prefills_whole_prompts(slots: usize, max_steps: usize) -> bool {
    slots < max_steps
}

/// How many of a prompt's `pending` tokens the next prefill row computes, with `budget` tokens
/// left in the launch: a chunk of at most the budget — or, when `whole` (a KV layout in which
/// loop steps share a slot), the whole prompt or nothing, since there the prompt's tokens attend
/// to each other's same-step K/V only within one launch and a chunk boundary would change the
/// function. A whole prompt over the budget goes only into an otherwise empty launch.
pub fn prefill_chunk(pending: usize, budget: usize, whole: bool, launch_empty: bool) -> usize {
    match whole {
        false => pending.min(budget),
        true if pending <= budget || launch_empty => pending,
        true => 0,
    }
}

/// Counters a scheduler keeps about its own decisions, read by the engine after every launch
/// into [`crate::EngineMetrics`]. Fields a scheduler does not track stay at their defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Requests preempted so far (their KV freed and recomputed later).
    pub preemptions: u64,
    /// Looped schedulers: `depth_histogram[d - 1]` = generated tokens that ran `d` loop steps
    /// (first tokens count at r_max).
    pub depth_histogram: Vec<u64>,
    /// Diffusion schedulers under an eviction policy: `(tokens revealed, of them in the step's
    /// kept set)` so far — FOCUS's recall of decodable tokens in shadow mode.
    pub revealed_in_kept: Option<(u64, u64)>,
}

/// What every scheduler does, whatever the model family: take and forget requests, count them,
/// own the KV bookkeeping. The family traits ([`crate::looped::LoopedScheduler`], [`crate::diffusion::DiffusionScheduler`]) add
/// `schedule` and `complete` over their own launch types.
pub trait Scheduler: Send {
    fn name(&self) -> &'static str;
    /// Queues a validated request. Its prompt and `max_new_tokens` fit the KV pool.
    fn add(&mut self, request: SchedRequest);
    /// Forgets a request (finished or aborted) and frees its KV blocks. Unknown ids are ignored.
    fn finish(&mut self, id: RequestId);
    fn num_waiting(&self) -> usize;
    fn num_running(&self) -> usize;
    fn kv(&self) -> &KvManager;
    /// Counters for the engine's metrics (default: none kept).
    fn stats(&self) -> SchedulerStats {
        SchedulerStats::default()
    }
    /// Cache positions a request of `prompt_len` prompt tokens and `max_new_tokens` needs at
    /// most (diffusion rounds up to whole blocks).
    fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        prompt_len + max_new_tokens
    }
}
