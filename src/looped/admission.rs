//! The prefill rules both built-in looped schedulers share: when a full-depth prefill may be
//! admitted while others decode, and how a prompt is cut into launch-sized chunks.

use crate::scheduler::SchedulerLimits;

/// While requests are decoding, admit a prefill only once `min_free_slots` resident slots are
/// free (or every waiting request fits), so one prefill launch takes many prompts. `None`:
/// `max(1, max_num_seqs / 16)`.
pub(crate) fn admits_prefill(limits: &SchedulerLimits, min_free_slots: Option<usize>, decoding: bool, free_slots: usize, waiting: usize) -> bool {
    let min_free = min_free_slots.unwrap_or((limits.max_num_seqs / 16).max(1));
    !decoding || free_slots >= min_free.min(waiting)
}

/// Whether prompts must be prefilled whole: a layout with fewer cache slots than loop steps makes
/// steps share a slot, and then a chunk boundary changes the function (see [`prefill_chunk`]).
pub(crate) fn prefills_whole_prompts(slots: usize, max_steps: usize) -> bool {
    slots < max_steps
}

/// How many of a prompt's `pending` tokens the next prefill row computes, with `budget` tokens
/// left in the launch: a chunk of at most the budget — or, when `whole` (a KV layout in which
/// loop steps share a slot), the whole prompt or nothing, since there the prompt's tokens attend
/// to each other's same-step K/V only within one launch and a chunk boundary would change the
/// function. A whole prompt over the budget goes only into an otherwise empty launch.
pub(crate) fn prefill_chunk(pending: usize, budget: usize, whole: bool, launch_empty: bool) -> usize {
    match whole {
        false => pending.min(budget),
        true if pending <= budget || launch_empty => pending,
        true => 0,
    }
}
