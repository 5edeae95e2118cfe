//! Options of looped models (Ouro, Huginn): scheduler, exit gate, KV layout, coda batching,
//! CUDA graphs, overlap — set with `EngineBuilder::looped(|o| …)`. An option of the other family
//! cannot be set on an in-memory looped model (its builder has no such method) and is one typed
//! error, [`crate::Error::WrongFamily`], for a checkpoint directory of the other family.

use super::gate::ExitGate;
use super::layout::{KvLayout, KvLayoutKind};
use super::models::{InitialState, LoopedSpec};
use super::LoopedScheduler;
use crate::scheduler::SchedulerLimits;
use crate::{Error, Result};

/// The built-in looped schedulers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulerKind {
    /// Full-depth continuous batching (the CB baseline).
    #[default]
    Continuous,
    /// Continuous depth batching: per-iteration scheduling with the exit gate; `refill` tops
    /// the recurrent batch up as rows exit, no-refill runs lock-step waves.
    Depth { refill: bool },
}

impl std::str::FromStr for SchedulerKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cb" | "continuous" => Ok(Self::Continuous),
            "cdb-refill" | "refill" => Ok(Self::Depth { refill: true }),
            "cdb-no-refill" | "no-refill" => Ok(Self::Depth { refill: false }),
            other => Err(Error::InvalidOption(format!("unknown scheduler `{other}` (cb, cdb-refill, cdb-no-refill)"))),
        }
    }
}

/// What a custom looped scheduler is built from.
#[derive(Debug)]
pub struct SchedulerContext {
    pub limits: SchedulerLimits,
    /// Which slot each loop step reads and writes (checked against the gate unless the
    /// scheduler is custom); every request holds a block table per slot.
    pub layout: Box<dyn KvLayout>,
    pub spec: LoopedSpec,
    /// The configured exit gate (fixed full depth unless one was set).
    pub gate: Box<dyn ExitGate>,
}

pub(crate) type LoopedFactory = Box<dyn FnOnce(SchedulerContext) -> Box<dyn LoopedScheduler> + Send>;

/// Options for looped models (Ouro, Huginn).
pub struct LoopedOptions {
    pub(crate) scheduler: SchedulerKind,
    pub(crate) factory: Option<LoopedFactory>,
    pub(crate) layout: Option<Box<dyn KvLayout>>,
    pub(crate) gate: Option<Box<dyn ExitGate>>,
    pub(crate) min_coda_batch_size: Option<usize>,
    pub(crate) coda_reserve: usize,
    pub(crate) cuda_graphs: bool,
    pub(crate) graph_capture: bool,
    pub(crate) overlap: bool,
    pub(crate) time_device: bool,
    pub(crate) initial_state: Option<InitialState>,
}

impl Default for LoopedOptions {
    fn default() -> Self {
        Self {
            scheduler: SchedulerKind::default(),
            factory: None,
            layout: None,
            gate: None,
            min_coda_batch_size: None,
            coda_reserve: 0,
            cuda_graphs: true,
            graph_capture: true,
            overlap: false,
            time_device: false,
            initial_state: None,
        }
    }
}

impl LoopedOptions {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn scheduler(mut self, kind: SchedulerKind) -> Self {
        self.scheduler = kind;
        self
    }
    /// Uses a scheduler of your own instead of a built-in one.
    pub fn custom_scheduler(mut self, f: impl FnOnce(SchedulerContext) -> Box<dyn LoopedScheduler> + Send + 'static) -> Self {
        self.factory = Some(Box::new(f));
        self
    }
    pub fn kv_layout(mut self, kind: KvLayoutKind) -> Self {
        self.layout = Some(kind.build());
        self
    }
    /// A KV layout of your own.
    pub fn custom_kv_layout(mut self, layout: Box<dyn KvLayout>) -> Self {
        self.layout = Some(layout);
        self
    }
    /// The exit gate depth schedulers obey (default: fixed full depth).
    pub fn exit_gate(mut self, gate: impl ExitGate + 'static) -> Self {
        self.gate = Some(Box::new(gate));
        self
    }
    /// An exit gate already boxed.
    pub fn exit_gate_boxed(mut self, gate: Box<dyn ExitGate>) -> Self {
        self.gate = Some(gate);
        self
    }
    /// Depth schedulers hold the coda until this many exited tokens wait (default 1, or a
    /// quarter of `max_num_seqs` for models whose coda runs transformer blocks, like Huginn).
    pub fn min_coda_batch_size(mut self, n: usize) -> Self {
        self.min_coda_batch_size = Some(n);
        self
    }
    /// Depth batching with refill: let this many requests be resident beyond `max_num_seqs`
    /// (default 0), so that tokens parked for a held coda do not leave the core launch short.
    /// Launches still hold at most `max_num_seqs` rows; KV is reserved for the extra requests
    /// too. `min_coda_batch_size − 1` parks at most that many.
    pub fn coda_reserve(mut self, n: usize) -> Self {
        self.coda_reserve = n;
        self
    }
    /// Replays decode launches (core steps, full-depth decode, coda) as CUDA graphs captured
    /// once per padded shape (default on; ignored on the CPU).
    pub fn cuda_graphs(mut self, on: bool) -> Self {
        self.cuda_graphs = on;
        self
    }
    /// With CUDA graphs on, capture them (default). Off, the graph path's bodies run eagerly
    /// over the same padded static buffers and bucketed contexts: for telling a padding effect
    /// from a capture effect when a graph run disagrees with an eager one.
    pub fn graph_capture(mut self, on: bool) -> Self {
        self.graph_capture = on;
        self
    }
    /// Issue each launch before reading the previous one's results (see
    /// [`crate::Engine::set_overlap`]); needs depth batching with a lookahead, replay or fixed gate.
    pub fn overlap(mut self, on: bool) -> Self {
        self.overlap = on;
        self
    }
    /// On CUDA: measure each launch's device-side span with a pair of stream events into
    /// `metrics().stages[..].device_time` — exact per stage even with overlap, where the host's
    /// wait on a launch covers the work queued ahead of it. No effect off CUDA.
    pub fn time_device(mut self, on: bool) -> Self {
        self.time_device = on;
        self
    }
    /// Huginn loaded from a model directory: the state each token's recurrence starts from
    /// (default [`InitialState::Zeros`], as the CDB authors serve it). Other models, and models
    /// passed in memory (call `Huginn::with_initial_state` on those), are a typed error.
    pub fn huginn_initial_state(mut self, init: InitialState) -> Self {
        self.initial_state = Some(init);
        self
    }
}
