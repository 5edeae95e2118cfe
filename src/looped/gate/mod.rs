//! Exit gates decide, schedulers obey.
//!
//! After every loop step of a work item (one token of one request), the scheduler hands the
//! gate the step's signal and the item's [`GateState`]; the gate says whether the item exits
//! (its state goes to the coda) or runs another step. Gates hold no device state: signals are
//! small host values copied back from the launch.

mod by_name;
mod fixed;
mod latent_diff;
mod learned;
mod lookahead;
mod preloop;
mod q_exit;
mod replay;

pub use by_name::ouro_gate;
pub use fixed::FixedDepth;
pub use latent_diff::LatentDiff;
pub use learned::{GateHead, LearnedLookahead};
pub use lookahead::Lookahead;
pub use preloop::Preloop;
pub use q_exit::QExit;
pub use replay::{DepthTrace, Replay};

use crate::request::RequestId;

/// What a step reports for one item; each gate reads the signal it understands.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepSignals {
    /// The model's exit-gate logit z_r (Ouro; hazard λ = sigmoid(z)).
    pub logit: Option<f32>,
    /// Relative latent change ‖s_r − s_{r−1}‖ / ‖s_r‖ (any looped model).
    pub latent_diff: Option<f32>,
}

impl StepSignals {
    pub fn logit(z: f32) -> Self {
        Self { logit: Some(z), latent_diff: None }
    }
    pub fn latent_diff(d: f32) -> Self {
        Self { logit: None, latent_diff: Some(d) }
    }
}

/// Per-item gate bookkeeping, plain data carried by the scheduler's work item.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GateState {
    /// Ouro: exit probability mass accumulated so far.
    pub cdf: f32,
    /// Ouro: probability of not having exited yet.
    pub survival: f32,
    /// Lookahead: the inner gate's verdict on the previous step, consumed one step late.
    pub pending_exit: bool,
    /// Free for gates written outside the crate (a previous signal, a running average…): zero
    /// at each token's first step, kept across its steps, never read by the built-in gates.
    pub scratch: [f32; 4],
}

impl GateState {
    pub fn new() -> Self {
        Self { cdf: 0.0, survival: 1.0, pending_exit: false, scratch: [0.0; 4] }
    }
}

/// Which item a decision is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemRef {
    pub request: RequestId,
    /// Index of the generated token within its request (0 = the token the prefill samples, so
    /// loop items start at 1).
    pub token_index: usize,
    /// The token entering the loop (the previous token of the request), when it is on the host.
    /// With overlap a successor's first step can be scheduled before the token sampled for it
    /// has been read back; by the time that step's verdict is asked for, it has.
    pub input_token: Option<u32>,
}

/// The loop steps a gate lets an item run: at least `min`, at most `max`, `1 <= min <= max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepBounds {
    min: usize,
    max: usize,
}

impl StepBounds {
    pub fn new(min: usize, max: usize) -> crate::Result<Self> {
        if min == 0 || min > max {
            return Err(crate::Error::InvalidOption(format!("exit gate needs 1 <= min_steps ({min}) <= max_steps ({max})")));
        }
        Ok(Self { min, max })
    }
    /// Exactly `depth` steps.
    pub fn exactly(depth: usize) -> crate::Result<Self> {
        Self::new(depth, depth)
    }
    pub fn min(self) -> usize {
        self.min
    }
    pub fn max(self) -> usize {
        self.max
    }
    /// A raw verdict after 0-based `step`, within the bounds: exit is forced after `max` steps
    /// and refused before `min`.
    pub fn apply(self, raw: bool, step: usize) -> bool {
        let done = step + 1;
        done >= self.max || (raw && done >= self.min)
    }
    /// `depth` clamped into the bounds.
    pub fn clamp(self, depth: usize) -> usize {
        depth.clamp(self.min, self.max)
    }
}

/// Turns per-step signals into continue/exit.
pub trait ExitGate: std::fmt::Debug + Send + Sync {
    fn name(&self) -> String;
    /// The loop steps an item runs (exit is forced after `max`).
    fn bounds(&self) -> StepBounds;
    /// Fewest loop steps every item runs.
    fn min_steps(&self) -> usize {
        self.bounds().min()
    }
    /// Most loop steps an item runs.
    fn max_steps(&self) -> usize {
        self.bounds().max()
    }
    /// Called after 0-based `step` ran. Returns true if the item exits after this step.
    fn decide(&self, item: ItemRef, step: usize, signals: StepSignals, state: &mut GateState) -> bool;
    /// The verdict on "exit after `step`" if it is already known before the step's own signal
    /// arrives (lookahead, learned lookahead, preloop once the input token is on the host,
    /// replayed and fixed depths). A scheduler may then route the item while
    /// its step is still running on the device — the overlap of CDB. `decide` must return the
    /// same verdict when the signal does arrive. `None`: the verdict needs the step's signal.
    fn exit_known(&self, _item: ItemRef, _step: usize, _state: &GateState) -> Option<bool> {
        None
    }
    /// Whether `decide` reads [`StepSignals::latent_diff`]. When no gate does, the runner does
    /// not compute the relative latent change (about ten small kernels and a copy to the host
    /// per core launch, which count while a launch is weight-bound). Default: true.
    fn reads_latent_diff(&self) -> bool {
        true
    }
    /// A trained head the model's gate signal must come from instead of its own stock head
    /// (installed by the engine when it is built: [`crate::looped::models::LoopedModel::replace_gate_head`]).
    fn gate_head(&self) -> Option<&GateHead> {
        None
    }
    /// Whether `decide` reads [`StepSignals::logit`]. When no gate does, the model computes no
    /// gate logit and nothing is copied back for it. Default: true.
    fn reads_gate_logit(&self) -> bool {
        true
    }
    /// A head the gate applies to each token's prelude output (a preloop gate). The engine
    /// evaluates it once for every vocabulary entry when it is built
    /// ([`crate::looped::models::LoopedModel::prelude_head_table`]) and hands the result to
    /// [`ExitGate::install_token_table`].
    fn token_head(&self) -> Option<&GateHead> {
        None
    }
    /// Receives `token_head` evaluated over the vocabulary: row-major `[vocab, rows]` logits.
    fn install_token_table(&mut self, logits: Vec<f32>, vocab: usize) -> crate::Result<()> {
        let _ = (logits, vocab);
        Ok(())
    }
}
