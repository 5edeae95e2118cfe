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
    /// Slots that receive a copy of the token's K/V when it exits after `exit_step`, so later
    /// tokens at deeper steps find it (last-exited). Empty for layouts that need no fill.
    fn fill_on_exit(&self, _exit_step: usize, _max_steps: usize) -> Vec<usize> {
        Vec::new()
    }
    /// Whether the layout fills the slots an early exit skips. If not, every slot must be
    /// written before a token may exit: gates must run at least `num_slots` steps.
    fn fills_on_exit(&self) -> bool {
        false
    }
}

/// Checks a layout's shape for a model of `max_steps` loop steps: at least one slot, every
/// step's slot and every exit fill among them (a custom layout that breaks this would make the
/// KV manager index past its tables).
pub(crate) fn check_shape(layout: &dyn KvLayout, max_steps: usize) -> crate::Result<()> {
    let slots = layout.num_slots(max_steps);
    let bad = |what: String| Err(crate::Error::InvalidOption(format!("KV layout `{}`: {what}", layout.name())));
    if slots == 0 {
        return bad("0 slots".into());
    }
    for step in 0..max_steps {
        let slot = layout.slot_for_step(step);
        if slot >= slots {
            return bad(format!("step {step} maps to slot {slot} of {slots}"));
        }
        if let Some(&fill) = layout.fill_on_exit(step, max_steps).iter().find(|&&f| f >= slots) {
            return bad(format!("an exit after step {step} fills slot {fill} of {slots}"));
        }
    }
    Ok(())
}

/// Checks that `layout` is safe with exits in `min_steps..=max_steps`: a static per-step layout
/// whose slots an early exit would leave stale is rejected with a clear error.
pub fn check_layout(layout: &dyn KvLayout, min_steps: usize, max_steps: usize) -> crate::Result<()> {
    let slots = layout.num_slots(max_steps);
    if !layout.fills_on_exit() && min_steps < slots {
        // Suggest only layouts that fit this gate: first-then-shared needs at least 2 steps.
        let others: Vec<&str> = ["last-exited", "shared", "first-then-shared"]
            .into_iter()
            .filter(|&n| n != layout.name() && (n != "first-then-shared" || min_steps >= 2))
            .collect();
        return Err(crate::Error::InvalidOption(format!(
            "KV layout `{}` has {slots} slots per layer but the exit gate may stop after {min_steps} step(s): \
             later tokens would read slots that were never written. Use min_steps >= {slots}, or the \
             `{}` layout",
            layout.name(),
            others.join("` or `")
        )));
    }
    Ok(())
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

/// Depth-indexed slots, plus: on exit at step e the token's K/V of slot e is copied into slots
/// e+1..r_max−1 of every layer, so deeper tokens read its exit-step K/V. Correct under any
/// exit; r_max× memory and the copy traffic.
#[derive(Debug, Clone, Copy, Default)]
pub struct LastExited;

impl KvLayout for LastExited {
    fn name(&self) -> &'static str {
        "last-exited"
    }
    fn num_slots(&self, max_steps: usize) -> usize {
        max_steps
    }
    fn slot_for_step(&self, step: usize) -> usize {
        step
    }
    fn fill_on_exit(&self, exit_step: usize, max_steps: usize) -> Vec<usize> {
        (exit_step + 1..max_steps).collect()
    }
    fn fills_on_exit(&self) -> bool {
        true
    }
}

/// A private slot for step 0 and one shared slot for every later step.
#[derive(Debug, Clone, Copy, Default)]
pub struct FirstThenShared;

impl KvLayout for FirstThenShared {
    fn name(&self) -> &'static str {
        "first-then-shared"
    }
    fn num_slots(&self, max_steps: usize) -> usize {
        max_steps.min(2)
    }
    fn slot_for_step(&self, step: usize) -> usize {
        step.min(1)
    }
}

/// The built-in layouts by name, for builders and command lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvLayoutKind {
    #[default]
    DepthIndexed,
    Shared,
    LastExited,
    FirstThenShared,
}

impl KvLayoutKind {
    pub const ALL: [KvLayoutKind; 4] = [Self::DepthIndexed, Self::LastExited, Self::Shared, Self::FirstThenShared];

    pub fn build(self) -> Box<dyn KvLayout> {
        match self {
            Self::DepthIndexed => Box::new(DepthIndexed),
            Self::Shared => Box::new(Shared),
            Self::LastExited => Box::new(LastExited),
            Self::FirstThenShared => Box::new(FirstThenShared),
        }
    }
}

impl std::str::FromStr for KvLayoutKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "depth-indexed" | "depth_indexed" => Ok(Self::DepthIndexed),
            "shared" | "single" => Ok(Self::Shared),
            "last-exited" | "last_exited" => Ok(Self::LastExited),
            "first-then-shared" | "first_then_shared" => Ok(Self::FirstThenShared),
            other => Err(crate::Error::InvalidOption(format!("unknown KV layout `{other}`"))),
        }
    }
}
