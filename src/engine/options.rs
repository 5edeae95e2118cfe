//! Per-family engine options. Looped models take [`LoopedOptions`] (scheduler, exit gate, KV
//! layout, coda batching, CUDA graphs, overlap); diffusion models take [`DiffusionOptions`]
//! (block length, unmasking, delayed cache, eviction); [`crate::EngineBuilder`] sets them with
//! `.looped(|o| …)` and `.diffusion(|o| …)`. An option of the wrong family cannot be set on an
//! in-memory model (its builder has no such method) and is one typed error,
//! [`crate::Error::WrongFamily`], for a checkpoint directory of the other family.

use crate::diffusion::{EvictionPolicy, UnmaskPolicy};
use crate::gate::ExitGate;
use crate::kv::{KvLayout, KvLayoutKind, KvManager};
use crate::models::diffusion::DiffusionSpec;
use crate::models::{InitialState, LoopedSpec};
use crate::scheduler::{DiffusionConfig, DiffusionScheduler, LoopedScheduler, SchedulerLimits};
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
    pub kv: KvManager,
    pub spec: LoopedSpec,
    /// The configured exit gate (fixed full depth unless one was set).
    pub gate: Box<dyn ExitGate>,
}

/// What a custom diffusion scheduler is built from.
#[derive(Debug)]
pub struct DiffusionSchedulerContext {
    pub limits: SchedulerLimits,
    /// One slot per layer; block tables cover whole decoding blocks.
    pub kv: KvManager,
    /// Block length, step cap, delayed cache, mask id, attention kind as configured.
    pub config: DiffusionConfig,
    /// The configured unmask policy (threshold 0.9 unless one was set).
    pub policy: Box<dyn UnmaskPolicy>,
    pub spec: DiffusionSpec,
}

pub(super) type LoopedFactory = Box<dyn FnOnce(SchedulerContext) -> Box<dyn LoopedScheduler> + Send>;
pub(super) type DiffusionFactory = Box<dyn FnOnce(DiffusionSchedulerContext) -> Box<dyn DiffusionScheduler> + Send>;

/// Options for looped models (Ouro, Huginn).
pub struct LoopedOptions {
    pub(super) scheduler: SchedulerKind,
    pub(super) factory: Option<LoopedFactory>,
    pub(super) layout: Option<Box<dyn KvLayout>>,
    pub(super) gate: Option<Box<dyn ExitGate>>,
    pub(super) min_coda_batch_size: Option<usize>,
    pub(super) coda_reserve: usize,
    pub(super) cuda_graphs: bool,
    pub(super) graph_capture: bool,
    pub(super) overlap: bool,
    pub(super) time_device: bool,
    pub(super) initial_state: Option<InitialState>,
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

/// Options for diffusion models (SDAR, LLaDA, Dream).
#[derive(Default)]
pub struct DiffusionOptions {
    pub(super) block_length: Option<usize>,
    pub(super) max_steps_per_block: Option<usize>,
    pub(super) delayed_cache: bool,
    pub(super) cache: Option<crate::diffusion::CanvasCache>,
    pub(super) whole_region: bool,
    pub(super) unmask: Option<Box<dyn UnmaskPolicy>>,
    pub(super) eviction: Option<Box<dyn EvictionPolicy>>,
    pub(super) eviction_shadow: bool,
    pub(super) time_phases: bool,
    pub(super) factory: Option<DiffusionFactory>,
}

impl DiffusionOptions {
    pub fn new() -> Self {
        Self::default()
    }
    /// Tokens per decoding block (default: the checkpoint's, else 32).
    pub fn block_length(mut self, n: usize) -> Self {
        self.block_length = Some(n);
        self
    }
    /// Denoising steps after which a block's remaining masks are all revealed (default: the
    /// block length).
    pub fn max_steps_per_block(mut self, n: usize) -> Self {
        self.max_steps_per_block = Some(n);
        self
    }
    /// Recompute only positions that are masked or whose right neighbour was masked a step ago,
    /// keeping the other K/V (dKV-Cache's delayed caching; approximate).
    pub fn delayed_cache(mut self, on: bool) -> Self {
        self.delayed_cache = on;
        self
    }
    /// Bidirectional models (LLaDA, Dream): what each step recomputes — the whole canvas
    /// ([`crate::diffusion::CanvasCache::Exact`], the default), or Fast-dLLM's prefix or dual
    /// cache (approximations). Refused for block-causal models, whose completed blocks are an
    /// exact prefix cache already.
    pub fn canvas_cache(mut self, cache: crate::diffusion::CanvasCache) -> Self {
        self.cache = Some(cache);
        self
    }
    /// Dream's own sampler: the whole generation is one block, denoised over `steps` steps on
    /// Dream's timestep schedule, ranked by `order` ([`crate::diffusion::Timesteps`]).
    /// Bidirectional models only.
    pub fn dream_sampler(mut self, steps: usize, order: crate::diffusion::Confidence) -> Self {
        self.whole_region = true;
        self.max_steps_per_block = Some(steps);
        match crate::diffusion::Timesteps::new(steps, order) {
            Ok(t) => self.unmask = Some(Box::new(t)),
            // Zero steps: refused when the engine is built.
            Err(_) => self.max_steps_per_block = Some(0),
        }
        self
    }
    /// Which masked tokens each step reveals (default: threshold 0.9).
    pub fn unmask_policy(mut self, policy: impl UnmaskPolicy + 'static) -> Self {
        self.unmask = Some(Box::new(policy));
        self
    }
    /// An unmask policy already boxed.
    pub fn unmask_policy_boxed(mut self, policy: Box<dyn UnmaskPolicy>) -> Self {
        self.unmask = Some(policy);
        self
    }
    /// Which masked tokens of a step run past layer 1 (default: all). FOCUS
    /// ([`crate::diffusion::Focus`]) needs the delayed cache.
    pub fn eviction_policy(mut self, policy: impl EvictionPolicy + 'static) -> Self {
        self.eviction = Some(Box::new(policy));
        self
    }
    /// Score and select with the eviction policy but run every token anyway, recording which
    /// the policy would have kept (its recall of decodable tokens:
    /// [`crate::EngineMetrics::eviction_recall`]).
    pub fn eviction_shadow(mut self, on: bool) -> Self {
        self.eviction_shadow = on;
        self
    }
    /// Time each phase of the denoise launches (embedding, layers, FOCUS selection and
    /// compaction, LM head + readout) into `metrics().denoise.phases`. The device is
    /// synchronised at every phase boundary, so steps run somewhat slower: for profiling.
    pub fn time_denoise_phases(mut self, on: bool) -> Self {
        self.time_phases = on;
        self
    }
    /// Uses a scheduler of your own (it issues [`crate::scheduler::DenoiseLaunch`]es and returns
    /// the tokens that became final from `complete`).
    pub fn custom_scheduler(mut self, f: impl FnOnce(DiffusionSchedulerContext) -> Box<dyn DiffusionScheduler> + Send + 'static) -> Self {
        self.factory = Some(Box::new(f));
        self
    }
}
