//! Options of diffusion models (SDAR, LLaDA, LLaDA2.0, Dream): block length, unmasking, delayed
//! cache, eviction — set with `EngineBuilder::diffusion(|o| …)`.

use super::models::DiffusionSpec;
use super::{DiffusionConfig, DiffusionScheduler, EvictionPolicy, UnmaskPolicy};
use crate::scheduler::SchedulerLimits;

/// What a custom diffusion scheduler is built from.
#[derive(Debug)]
pub struct DiffusionSchedulerContext {
    pub limits: SchedulerLimits,
    /// Block length, step cap, delayed cache, mask id, attention kind as configured.
    pub config: DiffusionConfig,
    /// The configured unmask policy (threshold 0.9 unless one was set).
    pub policy: Box<dyn UnmaskPolicy>,
    pub spec: DiffusionSpec,
}

pub(crate) type DiffusionFactory = Box<dyn FnOnce(DiffusionSchedulerContext) -> Box<dyn DiffusionScheduler> + Send>;

/// Options for diffusion models (SDAR, LLaDA, Dream).
#[derive(Default)]
pub struct DiffusionOptions {
    pub(crate) block_length: Option<usize>,
    pub(crate) max_steps_per_block: Option<usize>,
    pub(crate) delayed_cache: bool,
    pub(crate) cache: Option<crate::diffusion::CanvasCache>,
    pub(crate) whole_region: bool,
    pub(crate) unmask: Option<Box<dyn UnmaskPolicy>>,
    pub(crate) eviction: Option<Box<dyn EvictionPolicy>>,
    pub(crate) eviction_shadow: bool,
    pub(crate) time_phases: bool,
    pub(crate) factory: Option<DiffusionFactory>,
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
    /// [`crate::diffusion::DenoiseStats::recall`]).
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
    /// Uses a scheduler of your own (it issues [`crate::diffusion::DenoiseLaunch`]es and returns
    /// the tokens that became final from `complete`).
    pub fn custom_scheduler(mut self, f: impl FnOnce(DiffusionSchedulerContext) -> Box<dyn DiffusionScheduler> + Send + 'static) -> Self {
        self.factory = Some(Box::new(f));
        self
    }
}
