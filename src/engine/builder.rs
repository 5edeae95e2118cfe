//! Configuring and building an [`Engine`].

use super::core::ModelRunner;
use super::{DiffusionRunner, Engine, EngineHandle, LoopedRunner};
use crate::diffusion::{EvictionPolicy, Threshold, UnmaskPolicy};
use crate::gate::{ExitGate, FixedDepth};
use crate::kv::Shared;
use crate::kv::{check_layout, KvLayout, KvLayoutKind, KvManager};
use crate::loader::ModelDir;
use crate::models::diffusion::DiffusionModel;
use crate::models::looped::{Huginn, Ouro};
use crate::models::{InitialState, LoopedModel, LoopedSpec, ModelConfig};
use crate::scheduler::{ContinuousBatching, DepthBatching, DepthConfig, DiffusionBatching, DiffusionConfig, Scheduler, SchedulerLimits};
use crate::{Error, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;
use tokenizers::Tokenizer;

/// The built-in schedulers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SchedulerKind {
    /// Full-depth continuous batching (the CB baseline).
    #[default]
    Continuous,
    /// Continuous depth batching: per-iteration scheduling with the exit gate; `refill` tops
    /// the recurrent batch up as rows exit, no-refill runs lock-step waves.
    Depth { refill: bool },
    /// Block diffusion with first-done-first-out batching (diffusion models; chosen for them
    /// whenever the kind is left at its default).
    Diffusion,
}

impl std::str::FromStr for SchedulerKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cb" | "continuous" => Ok(Self::Continuous),
            "cdb-refill" | "refill" => Ok(Self::Depth { refill: true }),
            "cdb-no-refill" | "no-refill" => Ok(Self::Depth { refill: false }),
            "diffusion" => Ok(Self::Diffusion),
            other => Err(Error::InvalidOption(format!("unknown scheduler `{other}`"))),
        }
    }
}

/// What a custom scheduler is built from.
#[derive(Debug)]
pub struct SchedulerContext {
    pub limits: SchedulerLimits,
    pub kv: KvManager,
    pub spec: LoopedSpec,
    /// The configured exit gate (fixed full depth unless one was set).
    pub gate: Box<dyn ExitGate>,
}

type SchedulerFactory = Box<dyn FnOnce(SchedulerContext) -> Box<dyn Scheduler> + Send>;

/// What a custom scheduler for a diffusion model is built from.
#[derive(Debug)]
pub struct DiffusionSchedulerContext {
    pub limits: SchedulerLimits,
    /// One slot per layer; block tables cover whole decoding blocks.
    pub kv: KvManager,
    /// Block length, step cap, delayed cache, mask id, attention kind as configured.
    pub config: DiffusionConfig,
    /// The configured unmask policy (threshold 0.9 unless one was set).
    pub policy: Box<dyn UnmaskPolicy>,
    pub spec: crate::models::diffusion::DiffusionSpec,
}

type DiffusionSchedulerFactory = Box<dyn FnOnce(DiffusionSchedulerContext) -> Box<dyn Scheduler> + Send>;

enum Source {
    Dir(PathBuf),
    Model { model: Box<dyn LoopedModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32> },
    Diffusion { model: Box<dyn DiffusionModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32> },
}

/// A loaded model of either family.
enum Loaded {
    Looped(Box<dyn LoopedModel>),
    Diffusion(Box<dyn DiffusionModel>),
}

/// Builds an [`Engine`]: model source, device, dtype, scheduler, KV layout and limits.
pub struct EngineBuilder {
    source: Source,
    device: Device,
    dtype: DType,
    scheduler: SchedulerKind,
    factory: Option<SchedulerFactory>,
    layout: Option<Box<dyn KvLayout>>,
    limits: SchedulerLimits,
    block_size: usize,
    kv_tokens: Option<usize>,
    max_model_len: Option<usize>,
    gate: Option<Box<dyn ExitGate>>,
    min_coda_batch_size: Option<usize>,
    coda_reserve: usize,
    cuda_graphs: bool,
    overlap: bool,
    block_length: Option<usize>,
    max_steps_per_block: Option<usize>,
    delayed_cache: bool,
    unmask: Option<Box<dyn UnmaskPolicy>>,
    eviction: Option<Box<dyn EvictionPolicy>>,
    eviction_shadow: bool,
    time_denoise_phases: bool,
    time_device: bool,
    initial_state: Option<InitialState>,
    diffusion_factory: Option<DiffusionSchedulerFactory>,
}

impl EngineBuilder {
    /// An engine for the model directory at `path` (config.json, safetensors, tokenizer.json).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self::with_source(Source::Dir(path.into()))
    }

    /// An engine for a model already in memory (random-weight benchmarks, tests).
    pub fn from_model(model: Box<dyn LoopedModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32>) -> Self {
        let device = model.device().clone();
        let dtype = model.spec().dtype;
        let mut b = Self::with_source(Source::Model { model, tokenizer, eos });
        b.device = device;
        b.dtype = dtype;
        b
    }

    /// An engine for a diffusion model already in memory.
    pub fn from_diffusion_model(model: Box<dyn DiffusionModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32>) -> Self {
        let device = model.device().clone();
        let dtype = model.spec().dtype;
        let mut b = Self::with_source(Source::Diffusion { model, tokenizer, eos });
        b.device = device;
        b.dtype = dtype;
        b
    }

    fn with_source(source: Source) -> Self {
        Self {
            source,
            device: Device::Cpu,
            dtype: DType::F32,
            scheduler: SchedulerKind::default(),
            factory: None,
            layout: None,
            limits: SchedulerLimits::default(),
            block_size: 16,
            kv_tokens: None,
            max_model_len: None,
            gate: None,
            min_coda_batch_size: None,
            coda_reserve: 0,
            cuda_graphs: true,
            overlap: false,
            block_length: None,
            max_steps_per_block: None,
            delayed_cache: false,
            unmask: None,
            eviction: None,
            eviction_shadow: false,
            time_denoise_phases: false,
            time_device: false,
            initial_state: None,
            diffusion_factory: None,
        }
    }

    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }
    /// Weight and activation dtype (f32, bf16 or f16). Norm statistics are f32 regardless.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }
    pub fn scheduler(mut self, kind: SchedulerKind) -> Self {
        self.scheduler = kind;
        self
    }
    /// Uses a scheduler of your own for a diffusion model (it must emit finalised tokens through
    /// [`Scheduler::take_emitted`] and issue `Stage::Denoise` launches).
    pub fn custom_diffusion_scheduler(mut self, f: impl FnOnce(DiffusionSchedulerContext) -> Box<dyn Scheduler> + Send + 'static) -> Self {
        self.diffusion_factory = Some(Box::new(f));
        self
    }
    /// Uses a scheduler of your own instead of a built-in one.
    pub fn custom_scheduler(mut self, f: impl FnOnce(SchedulerContext) -> Box<dyn Scheduler> + Send + 'static) -> Self {
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
    /// Most requests decoding at once (the width W).
    pub fn max_num_seqs(mut self, n: usize) -> Self {
        self.limits.max_num_seqs = n;
        self
    }
    /// Most tokens in one prefill launch.
    pub fn max_num_batched_tokens(mut self, n: usize) -> Self {
        self.limits.max_num_batched_tokens = n;
        self
    }
    /// Tokens per KV block (default 16).
    pub fn block_size(mut self, n: usize) -> Self {
        self.block_size = n;
        self
    }
    /// KV capacity in token positions across all slots (default: 16 384 per slot).
    pub fn kv_capacity_tokens(mut self, n: usize) -> Self {
        self.kv_tokens = Some(n);
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
    /// Issue each launch before reading the previous one's results (see
    /// [`Engine::set_overlap`]); needs depth batching with a lookahead, replay or fixed gate.
    pub fn overlap(mut self, on: bool) -> Self {
        self.overlap = on;
        self
    }
    /// Diffusion models: tokens per decoding block (default: the checkpoint's, else 32).
    pub fn block_length(mut self, n: usize) -> Self {
        self.block_length = Some(n);
        self
    }
    /// Diffusion models: denoising steps after which a block's remaining masks are all
    /// revealed (default: the block length).
    pub fn max_steps_per_block(mut self, n: usize) -> Self {
        self.max_steps_per_block = Some(n);
        self
    }
    /// Diffusion models: recompute only positions that are masked or whose right neighbour was
    /// masked a step ago, keeping the other K/V (dKV-Cache's delayed caching; approximate).
    pub fn delayed_cache(mut self, on: bool) -> Self {
        self.delayed_cache = on;
        self
    }
    /// Diffusion models: which masked tokens each step reveals (default: threshold 0.9).
    pub fn unmask_policy(mut self, policy: impl UnmaskPolicy + 'static) -> Self {
        self.unmask = Some(Box::new(policy));
        self
    }
    /// An unmask policy already boxed.
    pub fn unmask_policy_boxed(mut self, policy: Box<dyn UnmaskPolicy>) -> Self {
        self.unmask = Some(policy);
        self
    }
    /// Diffusion models: which masked tokens of a step run past layer 1 (default: all). FOCUS
    /// ([`crate::diffusion::Focus`]) needs the delayed cache.
    pub fn eviction_policy(mut self, policy: impl EvictionPolicy + 'static) -> Self {
        self.eviction = Some(Box::new(policy));
        self
    }
    /// Diffusion models: score and select with the eviction policy but run every token anyway,
    /// recording which the policy would have kept (its recall of decodable tokens:
    /// [`crate::EngineMetrics::eviction_recall`]).
    pub fn eviction_shadow(mut self, on: bool) -> Self {
        self.eviction_shadow = on;
        self
    }
    /// Diffusion models: time each phase of the denoise launches (embedding, layers, FOCUS
    /// selection and compaction, LM head + readout) into `metrics().denoise.phases`. The device
    /// is synchronised at every phase boundary, so steps run somewhat slower: for profiling.
    pub fn time_denoise_phases(mut self, on: bool) -> Self {
        self.time_denoise_phases = on;
        self
    }
    /// Looped models on CUDA: measure each launch's device-side span with a pair of stream
    /// events into `metrics().stages[..].device_time` — exact per stage even with overlap, where
    /// the host's wait on a launch covers the work queued ahead of it. No effect off CUDA;
    /// diffusion models time their phases with [`EngineBuilder::time_denoise_phases`] instead.
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
    /// Caps the context window below the model's own.
    pub fn max_model_len(mut self, n: usize) -> Self {
        self.max_model_len = Some(n);
        self
    }

    /// Loads the model and allocates the KV cache.
    pub fn build(mut self) -> Result<Engine> {
        if self.block_size == 0 {
            return Err(Error::InvalidOption("block_size must be > 0".into()));
        }
        if self.limits.max_num_seqs == 0 || self.limits.max_num_batched_tokens == 0 {
            return Err(Error::InvalidOption("max_num_seqs and max_num_batched_tokens must be > 0".into()));
        }
        if !crate::ops::is_float(self.dtype) {
            return Err(Error::InvalidOption(format!("dtype {:?} is not a float type", self.dtype)));
        }
        let source = std::mem::replace(&mut self.source, Source::Dir(PathBuf::new()));
        let (model, tokenizer, eos) = match source {
            Source::Dir(path) => {
                let dir = ModelDir::open(&path)?;
                let weights = dir.weights(self.dtype, &self.device)?;
                let model = match &dir.config {
                    ModelConfig::Ouro(c) => Loaded::Looped(Box::new(Ouro::load(c, &weights)?)),
                    ModelConfig::Huginn(c) => {
                        let init = self.initial_state.take().unwrap_or_default();
                        Loaded::Looped(Box::new(Huginn::load(c, &weights)?.with_initial_state(init)?))
                    }
                    other => Loaded::Diffusion(Box::new(crate::models::diffusion::load(other, &weights)?)),
                };
                (model, dir.tokenizer()?, dir.eos_token_ids.clone())
            }
            Source::Model { model, tokenizer, eos } => (Loaded::Looped(model), tokenizer, eos),
            Source::Diffusion { model, tokenizer, eos } => (Loaded::Diffusion(model), tokenizer, eos),
        };
        if self.initial_state.is_some() {
            return Err(Error::InvalidOption(
                "huginn_initial_state applies to Huginn loaded from a model directory (in memory: Huginn::with_initial_state)".into(),
            ));
        }
        let model = match model {
            Loaded::Looped(m) => m,
            Loaded::Diffusion(m) => return self.build_diffusion(m, tokenizer, eos),
        };
        if self.scheduler == SchedulerKind::Diffusion {
            return Err(Error::InvalidOption("the diffusion scheduler needs a diffusion model".into()));
        }
        if self.coda_reserve > 0 && (self.scheduler != (SchedulerKind::Depth { refill: true }) || self.factory.is_some()) {
            return Err(Error::InvalidOption("coda_reserve applies to the built-in depth scheduler with refill only".into()));
        }
        // Resident requests index the state bank with u32 rows.
        if self.limits.max_num_seqs.checked_add(self.coda_reserve).is_none_or(|n| n > u32::MAX as usize) {
            return Err(Error::InvalidOption(format!(
                "max_num_seqs {} + coda_reserve {} exceeds {} resident requests",
                self.limits.max_num_seqs,
                self.coda_reserve,
                u32::MAX
            )));
        }
        for (set, what) in [
            (self.block_length.is_some(), "block_length"),
            (self.max_steps_per_block.is_some(), "max_steps_per_block"),
            (self.delayed_cache, "delayed_cache"),
            (self.unmask.is_some(), "unmask_policy"),
            (self.eviction.is_some() || self.eviction_shadow, "eviction_policy"),
            (self.time_denoise_phases, "time_denoise_phases"),
            (self.diffusion_factory.is_some(), "custom_diffusion_scheduler"),
        ] {
            if set {
                return Err(Error::InvalidOption(format!("{what} applies to diffusion models only")));
            }
        }
        let spec = model.spec().clone();
        let layout = self.layout.unwrap_or_else(|| KvLayoutKind::default().build());
        crate::kv::check_shape(layout.as_ref(), spec.max_steps)?;
        let slots = layout.num_slots(spec.max_steps);
        let kv_tokens = self.kv_tokens.unwrap_or(16_384 * slots);
        let num_blocks = kv_tokens.div_ceil(self.block_size);
        let max_context = self.max_model_len.map_or(spec.max_context, |m| m.min(spec.max_context));
        let kv = KvManager::new(num_blocks, self.block_size, layout, spec.max_steps);
        let limits = self.limits.clone();
        let gate = match self.gate {
            Some(g) => g,
            None => Box::new(FixedDepth::new(spec.max_steps)?),
        };
        if gate.max_steps() > spec.max_steps {
            return Err(Error::InvalidOption(format!("exit gate allows {} steps but the model loops at most {} times", gate.max_steps(), spec.max_steps)));
        }
        let custom_scheduler = self.factory.is_some();
        // CB runs every token at full depth: a gate that would exit earlier would be ignored.
        if !custom_scheduler && self.scheduler == SchedulerKind::Continuous && gate.min_steps() < spec.max_steps {
            return Err(Error::InvalidOption(
                "an exit gate that exits before full depth needs SchedulerKind::Depth or a custom scheduler (CB runs every token at full depth)".into(),
            ));
        }
        // Only the built-in depth scheduler holds a coda (a custom one holds its own).
        if self.min_coda_batch_size.is_some() && (custom_scheduler || !matches!(self.scheduler, SchedulerKind::Depth { .. })) {
            return Err(Error::InvalidOption("min_coda_batch_size applies to the built-in depth scheduler (SchedulerKind::Depth)".into()));
        }
        let latent_diff = gate.reads_latent_diff();
        let scheduler: Box<dyn Scheduler> = match self.factory {
            Some(f) => f(SchedulerContext { limits: limits.clone(), kv, spec: spec.clone(), gate }),
            None => match self.scheduler {
                SchedulerKind::Continuous => Box::new(ContinuousBatching::new(limits.clone(), kv, spec.max_steps)),
                SchedulerKind::Diffusion => unreachable!("refused above"),
                SchedulerKind::Depth { refill } => {
                    check_layout(kv.layout(), gate.min_steps(), gate.max_steps())?;
                    let min_coda = self.min_coda_batch_size.unwrap_or(if spec.heavy_coda { (limits.max_num_seqs / 4).max(1) } else { 1 });
                    if min_coda == 0 {
                        return Err(Error::InvalidOption("min_coda_batch_size must be >= 1".into()));
                    }
                    let cfg = DepthConfig { refill, min_coda_batch_size: min_coda, coda_reserve: self.coda_reserve, ..DepthConfig::default() };
                    Box::new(DepthBatching::new(cfg, limits.clone(), kv, gate))
                }
            },
        };
        let runner = LoopedRunner::with_cuda_graphs(model, num_blocks, self.block_size, scheduler.state_bank_rows(), self.cuda_graphs)?
            .with_launch_checks(custom_scheduler)
            .with_device_timing(self.time_device)
            .with_latent_diff(latent_diff);
        let mut engine = Engine::assemble(ModelRunner::Looped(runner), scheduler, tokenizer, eos, max_context, limits.max_num_batched_tokens);
        engine.set_overlap(self.overlap)?;
        Ok(engine)
    }

    /// The diffusion half of [`EngineBuilder::build`]: one KV slot per layer, the block
    /// diffusion scheduler, no exit gates or loop layouts.
    fn build_diffusion(self, model: Box<dyn DiffusionModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32>) -> Result<Engine> {
        let spec = model.spec().clone();
        let refuse = |what: &str| Err(Error::InvalidOption(format!("{what} does not apply to diffusion model `{}`", spec.model_type)));
        if self.layout.is_some() {
            return refuse("a KV layout");
        }
        if self.gate.is_some() {
            return refuse("an exit gate");
        }
        if self.factory.is_some() {
            return refuse("a looped-model custom scheduler (use custom_diffusion_scheduler)");
        }
        if self.time_device {
            return refuse("time_device (use time_denoise_phases)");
        }
        if let SchedulerKind::Depth { .. } = self.scheduler {
            return refuse("depth batching");
        }
        if self.min_coda_batch_size.is_some() || self.coda_reserve > 0 {
            return refuse("min_coda_batch_size / coda_reserve (looped models' coda)");
        }
        let block_length = self.block_length.or(spec.block_length).unwrap_or(32);
        let max_context = self.max_model_len.map_or(spec.max_context, |m| m.min(spec.max_context));
        if block_length == 0 || block_length > max_context {
            return Err(Error::InvalidOption(format!("block length {block_length} must be in 1..={max_context}")));
        }
        if max_context % block_length != 0 {
            return Err(Error::InvalidOption(format!(
                "block length {block_length} does not divide the context window {max_context} (blocks are aligned to it)"
            )));
        }
        let max_steps = self.max_steps_per_block.unwrap_or(block_length);
        if max_steps == 0 {
            return Err(Error::InvalidOption("max_steps_per_block must be >= 1".into()));
        }
        let policy = match self.unmask {
            Some(p) => p,
            None => Box::new(Threshold::new(0.9)?),
        };
        let eviction = self.eviction.filter(|p| p.scores());
        if self.eviction_shadow && eviction.is_none() {
            return Err(Error::InvalidOption("eviction_shadow needs an eviction policy that scores tokens (e.g. Focus)".into()));
        }
        if let Some(p) = &eviction {
            if !self.eviction_shadow && !self.delayed_cache {
                return Err(Error::InvalidOption(format!("eviction policy {} needs the delayed cache (delayed_cache(true))", p.name())));
            }
            if spec.shift_logits {
                return Err(Error::InvalidOption(format!("eviction is not supported for shifted-logit models (`{}`)", spec.model_type)));
            }
            if spec.num_layers < 2 {
                return Err(Error::InvalidOption("eviction scores tokens at layers 0 and 1: the model needs two layers".into()));
            }
        }
        let evicts = eviction.is_some();
        let num_blocks = self.kv_tokens.unwrap_or(16_384).div_ceil(self.block_size);
        let kv = KvManager::new(num_blocks, self.block_size, Box::new(Shared), 1);
        let cfg = DiffusionConfig {
            block_length,
            max_steps_per_block: max_steps,
            delayed_cache: self.delayed_cache,
            mask_token_id: spec.mask_token_id,
            attention: spec.attention,
            shift_logits: spec.shift_logits,
            eviction: evicts,
        };
        let limits = self.limits.clone();
        let custom_scheduler = self.diffusion_factory.is_some();
        let scheduler: Box<dyn Scheduler> = match self.diffusion_factory {
            Some(f) => f(DiffusionSchedulerContext { limits: limits.clone(), kv, config: cfg, policy, spec: spec.clone() }),
            None => Box::new(DiffusionBatching::new(cfg, limits.clone(), kv, policy)),
        };
        let runner = DiffusionRunner::new(model, num_blocks, self.block_size, block_length)?
            .with_launch_checks(custom_scheduler)
            .with_eviction(eviction, self.eviction_shadow)
            .with_phase_timing(self.time_denoise_phases);
        let mut engine = Engine::assemble(ModelRunner::Diffusion(runner), scheduler, tokenizer, eos, max_context, limits.max_num_batched_tokens);
        engine.set_overlap(self.overlap)?;
        Ok(engine)
    }

    /// Builds the engine on its own thread and returns a handle that many threads can use.
    pub fn spawn(self) -> Result<EngineHandle> {
        EngineHandle::spawn(self)
    }
}
