//! Configuring and building an [`Engine`]: options every model takes live here; options of one
//! family live in [`LoopedOptions`] / [`DiffusionOptions`] (`engine/options.rs`).

use super::core::Family;
use super::metrics::KvPoolStats;
use super::{Engine, EngineHandle};
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::diffusion::models::DiffusionModel;
use crate::diffusion::runner::DiffusionRunner;
use crate::diffusion::Threshold;
use crate::diffusion::{DiffusionBatching, DiffusionConfig, DiffusionScheduler};
use crate::diffusion::{DiffusionHalf, DiffusionOptions, DiffusionSchedulerContext};
use crate::kv::{KvManager, MemoryNeed};
use crate::loader::ModelDir;
use crate::looped::gate::FixedDepth;
use crate::looped::layout::{check_layout, KvLayoutKind};
use crate::looped::models::LoopedModel;
use crate::looped::models::{Huginn, Ouro};
use crate::looped::runner::LoopedRunner;
use crate::looped::{ContinuousBatching, DepthBatching, DepthConfig, LoopedScheduler};
use crate::looped::{LoopedHalf, LoopedOptions, SchedulerContext, SchedulerKind};
use crate::ops::{AttentionKernels, KernelPolicy};
use crate::scheduler::SchedulerLimits;
use crate::{Error, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;
use tokenizers::Tokenizer;

/// Options every engine takes, whatever the model family.
struct Common {
    device: Device,
    dtype: DType,
    limits: SchedulerLimits,
    block_size: usize,
    kv_tokens: Option<usize>,
    kv_fraction: Option<f64>,
    max_model_len: Option<usize>,
    kernels: KernelPolicy,
    chat_template: Option<ChatTemplate>,
}

impl Common {
    /// Refuses options no engine can run with (before anything is loaded).
    fn check(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(Error::InvalidOption("block_size must be > 0".into()));
        }
        if self.limits.max_num_seqs == 0 || self.limits.max_num_batched_tokens == 0 {
            return Err(Error::InvalidOption("max_num_seqs and max_num_batched_tokens must be > 0".into()));
        }
        if let Some(f) = self.kv_fraction.filter(|f| !(f.is_finite() && *f > 0.0 && *f <= 1.0)) {
            return Err(Error::InvalidOption(format!("kv_memory_fraction {f} must be in (0, 1]")));
        }
        if !crate::ops::is_float(self.dtype) {
            return Err(Error::InvalidOption(format!("dtype {:?} is not a float type", self.dtype)));
        }
        Ok(())
    }

    fn max_context(&self, model_max: usize) -> usize {
        self.max_model_len.map_or(model_max, |m| m.min(model_max))
    }

    /// Blocks of the KV pool, sized before anything is allocated (see [`EngineBuilder::kv_memory_fraction`]):
    /// `slots` cache slots whose positions take `bytes_per_position` each, `useful` positions at
    /// most (what the resident requests can fill), and `reserved` bytes kept free beside it (a
    /// launch's workspace and the state bank). A count given by hand is rounded up to whole
    /// blocks; one sized from free memory down, so that it stays within what it was sized from.
    fn pool_blocks(&self, device: &Device, slots: usize, bytes_per_position: Option<u64>, reserved: u64, useful: usize) -> Result<usize> {
        let per_position = bytes_per_position.ok_or_else(|| Error::InvalidOption("the KV pool's size overflows 64 bits".into()))?;
        let sizing = crate::kv::PoolSizing { tokens: self.kv_tokens, fraction: self.kv_fraction };
        let tokens = sizing.pool_tokens(device, slots, per_position, reserved, useful)?;
        Ok(if self.pool_fitted(device) { (tokens / self.block_size).max(slots) } else { tokens.div_ceil(self.block_size) })
    }

    /// Whether the pool is sized from the device's free memory (already leaving room for what
    /// `pool_blocks` reserved) rather than given by hand or fixed.
    fn pool_fitted(&self, device: &Device) -> bool {
        self.kv_tokens.is_none() && (self.kv_fraction.is_some() || device.is_cuda())
    }
}

/// Most requests a looped engine may hold resident (`max_num_seqs` + `coda_reserve`).
pub const MAX_RESIDENT: usize = 1 << 20;

/// A model directory, with options for whichever family its checkpoint turns out to be.
pub struct Checkpoint {
    path: PathBuf,
    looped: Option<LoopedOptions>,
    diffusion: Option<DiffusionOptions>,
}

/// A looped model already in memory, with its options.
pub struct InMemoryLooped {
    model: Box<dyn LoopedModel>,
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
    options: LoopedOptions,
}

/// A diffusion model already in memory, with its options.
pub struct InMemoryDiffusion {
    model: Box<dyn DiffusionModel>,
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
    options: DiffusionOptions,
}

/// Builds an [`Engine`]: model source, device, dtype, limits, and the options of the model's
/// family. From a directory the checkpoint decides the family at run time; options of the other
/// family are then [`Error::WrongFamily`], raised before any weight is read. From a model in memory the family is known, and only
/// its own options can be set.
pub struct EngineBuilder<S = Checkpoint> {
    source: S,
    common: Common,
}

impl<S> EngineBuilder<S> {
    fn with_source(source: S, device: Device, dtype: DType) -> Self {
        let common = Common {
            device,
            dtype,
            limits: SchedulerLimits::default(),
            block_size: 16,
            kv_tokens: None,
            kv_fraction: None,
            max_model_len: None,
            kernels: KernelPolicy::default(),
            chat_template: None,
        };
        Self { source, common }
    }

    pub fn device(mut self, device: Device) -> Self {
        self.common.device = device;
        self
    }
    /// Weight and activation dtype (f32, bf16 or f16). Norm statistics are f32 regardless.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.common.dtype = dtype;
        self
    }
    /// Most requests decoding at once (the width W).
    pub fn max_num_seqs(mut self, n: usize) -> Self {
        self.common.limits.max_num_seqs = n;
        self
    }
    /// Launch budget (default 8192): most prompt tokens in one prefill launch. Longer prompts
    /// are prefilled in chunks of at most this many, interleaved with the decode launches of
    /// other requests; a prompt is limited only by the context window and the KV pool. A
    /// bidirectional diffusion step (LLaDA, Dream) reads its whole canvas in one row and cannot
    /// be split, so such a row may exceed the budget; it then runs without other new requests.
    pub fn max_num_batched_tokens(mut self, n: usize) -> Self {
        self.common.limits.max_num_batched_tokens = n;
        self
    }
    /// Tokens per KV block (default 16).
    pub fn block_size(mut self, n: usize) -> Self {
        self.common.block_size = n;
        self
    }
    /// KV capacity in token positions across all slots. Overrides
    /// [`EngineBuilder::kv_memory_fraction`]. Without either: on CUDA the pool takes 90 % of
    /// the free device memory; on the CPU it holds 16 384 positions per slot.
    pub fn kv_capacity_tokens(mut self, n: usize) -> Self {
        self.common.kv_tokens = Some(n);
        self
    }
    /// Sizes the KV pool from the device: this fraction (0, 1] of the memory free once the
    /// weights are loaded, less a workspace estimate for one launch (activations of
    /// `max_num_batched_tokens` positions, the logits of every readout row, 1 GiB of slack), and
    /// capped at what `max_num_seqs` requests of `max_model_len` could ever fill. The default on
    /// CUDA is 0.9, which fills most of an idle GPU like vLLM's `gpu_memory_utilization`; the CPU
    /// keeps a fixed default unless this is set (its free memory is `MemAvailable`). The pool
    /// built is reported in [`crate::EngineMetrics::kv_pool`].
    pub fn kv_memory_fraction(mut self, fraction: f64) -> Self {
        self.common.kv_fraction = Some(fraction);
        self
    }
    /// Caps the context window below the model's own.
    pub fn max_model_len(mut self, n: usize) -> Self {
        self.common.max_model_len = Some(n);
        self
    }
    /// The chat template [`crate::Prompt::Chat`] prompts are rendered with, instead of the
    /// checkpoint's own (`tokenizer_config.json` / `chat_template.jinja`); models in memory have
    /// none unless given here.
    pub fn chat_template(mut self, template: ChatTemplate) -> Self {
        self.common.chat_template = Some(template);
        self
    }
    /// CUDA: which kernels this engine's launches run ([`crate::kernels::KernelPolicy`]; the default is the
    /// fastest measured). For comparing kernels and checking one against another; results agree
    /// up to rounding. Other engines of the process keep their own.
    pub fn kernels(mut self, policy: KernelPolicy) -> Self {
        self.common.kernels = policy;
        self
    }
    /// CUDA: which paged-attention kernels run (the `attention` part of [`Self::kernels`]).
    pub fn attention_kernels(mut self, k: AttentionKernels) -> Self {
        self.common.kernels.attention = k;
        self
    }
}

impl EngineBuilder<Checkpoint> {
    /// An engine for the model directory at `path` (config.json, safetensors, tokenizer.json).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self::with_source(Checkpoint { path: path.into(), looped: None, diffusion: None }, Device::Cpu, DType::F32)
    }
    /// Sets options used if the checkpoint is a looped model (Ouro, Huginn):
    /// `.looped(|o| o.kv_layout(KvLayoutKind::Shared))`. Calls compose.
    pub fn looped(mut self, set: impl FnOnce(LoopedOptions) -> LoopedOptions) -> Self {
        self.source.looped = Some(set(self.source.looped.take().unwrap_or_default()));
        self
    }
    /// Sets options used if the checkpoint is a diffusion model (SDAR, LLaDA, Dream):
    /// `.diffusion(|o| o.delayed_cache(true))`. Calls compose. Options of the family the
    /// checkpoint is not are [`Error::WrongFamily`] (never silently ignored): a caller that
    /// does not know the family reads it first with [`ModelDir::open`].
    pub fn diffusion(mut self, set: impl FnOnce(DiffusionOptions) -> DiffusionOptions) -> Self {
        self.source.diffusion = Some(set(self.source.diffusion.take().unwrap_or_default()));
        self
    }

    /// Loads the model and allocates the KV cache.
    pub fn build(self) -> Result<Engine> {
        let Self { source, mut common } = self;
        common.check()?;
        let dir = ModelDir::open(&source.path)?;
        if common.chat_template.is_none() {
            common.chat_template = dir.chat()?;
        }
        let looped_model = matches!(dir.config, ModelConfig::Ouro(_) | ModelConfig::Huginn(_));
        // The one place a wrong-family option is refused: before any weight is read.
        let wrong = |options, family| Err(Error::WrongFamily { options, model_type: dir.config.model_type().into(), family });
        match (looped_model, &source.looped, &source.diffusion) {
            (true, _, Some(_)) => return wrong("diffusion", "looped"),
            (false, Some(_), _) => return wrong("looped", "diffusion"),
            _ => {}
        }
        let weights = dir.weights(common.dtype, &common.device)?;
        let (tokenizer, eos) = (dir.tokenizer()?, dir.eos_token_ids.clone());
        if !looped_model {
            let model = crate::diffusion::models::load(&dir.config, &weights)?;
            return build_diffusion(Box::new(model), tokenizer, eos, source.diffusion.unwrap_or_default(), common);
        }
        let mut options = source.looped.unwrap_or_default();
        let model: Box<dyn LoopedModel> = match &dir.config {
            ModelConfig::Huginn(c) => {
                let init = options.initial_state.take().unwrap_or_default();
                Box::new(Huginn::load(c, &weights)?.with_initial_state(init)?)
            }
            ModelConfig::Ouro(c) => Box::new(Ouro::load(c, &weights)?),
            other => return Err(Error::UnsupportedModel(other.model_type().into())),
        };
        build_looped(model, tokenizer, eos, options, common)
    }

    /// Builds the engine on its own thread and returns a handle that many threads can use.
    pub fn spawn(self) -> Result<EngineHandle> {
        EngineHandle::spawn(move || self.build())
    }
}

impl EngineBuilder<InMemoryLooped> {
    /// An engine for a looped model already in memory (random-weight benchmarks, tests).
    pub fn from_model(model: Box<dyn LoopedModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32>) -> Self {
        let (device, dtype) = (model.device().clone(), model.spec().dtype);
        Self::with_source(InMemoryLooped { model, tokenizer, eos, options: LoopedOptions::default() }, device, dtype)
    }
    /// Sets the model's options: `.looped(|o| o.kv_layout(KvLayoutKind::Shared))`. Calls compose.
    pub fn looped(mut self, set: impl FnOnce(LoopedOptions) -> LoopedOptions) -> Self {
        self.source.options = set(std::mem::take(&mut self.source.options));
        self
    }
    pub fn build(self) -> Result<Engine> {
        let Self { source: s, common } = self;
        common.check()?;
        build_looped(s.model, s.tokenizer, s.eos, s.options, common)
    }
    /// Builds the engine on its own thread and returns a handle that many threads can use.
    pub fn spawn(self) -> Result<EngineHandle> {
        EngineHandle::spawn(move || self.build())
    }
}

impl EngineBuilder<InMemoryDiffusion> {
    /// An engine for a diffusion model already in memory.
    pub fn from_diffusion_model(model: Box<dyn DiffusionModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32>) -> Self {
        let (device, dtype) = (model.device().clone(), model.spec().dtype);
        Self::with_source(InMemoryDiffusion { model, tokenizer, eos, options: DiffusionOptions::default() }, device, dtype)
    }
    /// Sets the model's options: `.diffusion(|o| o.delayed_cache(true))`. Calls compose.
    pub fn diffusion(mut self, set: impl FnOnce(DiffusionOptions) -> DiffusionOptions) -> Self {
        self.source.options = set(std::mem::take(&mut self.source.options));
        self
    }
    pub fn build(self) -> Result<Engine> {
        let Self { source: s, common } = self;
        common.check()?;
        build_diffusion(s.model, s.tokenizer, s.eos, s.options, common)
    }
    /// Builds the engine on its own thread and returns a handle that many threads can use.
    pub fn spawn(self) -> Result<EngineHandle> {
        EngineHandle::spawn(move || self.build())
    }
}

/// The looped half: KV layout and gate checked against the model and the scheduler, the state
/// bank sized by the scheduler, CUDA graphs and overlap as asked.
fn build_looped(mut model: Box<dyn LoopedModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32>, o: LoopedOptions, mut common: Common) -> Result<Engine> {
    if o.initial_state.is_some() {
        return Err(Error::InvalidOption(
            "huginn_initial_state applies to Huginn loaded from a model directory (in memory: Huginn::with_initial_state)".into(),
        ));
    }
    let custom = o.factory.is_some();
    let depth_refill = !custom && o.scheduler == (SchedulerKind::Depth { refill: true });
    if o.coda_reserve > 0 && !depth_refill {
        return Err(Error::InvalidOption("coda_reserve applies to the built-in depth scheduler with refill only".into()));
    }
    let limits = common.limits.clone();
    // Resident requests index the state bank with u32 rows, and the depth scheduler keeps a free
    // list of them on the host: a bound far above what any device holds at once.
    if limits.max_num_seqs.checked_add(o.coda_reserve).is_none_or(|n| n > MAX_RESIDENT) {
        return Err(Error::InvalidOption(format!(
            "max_num_seqs {} + coda_reserve {} exceeds {MAX_RESIDENT} resident requests",
            limits.max_num_seqs, o.coda_reserve
        )));
    }
    let spec = model.spec().clone();
    let max_context = common.max_context(spec.max_context);
    let layout = o.layout.unwrap_or_else(|| KvLayoutKind::default().build());
    crate::looped::layout::check_shape(layout.as_ref(), spec.max_steps)?;
    let slots = layout.num_slots(spec.max_steps);
    let per_position = crate::kv::kv_bytes(1, spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.dtype);
    // Layouts whose steps share a slot prefill a prompt whole, past the budget up to the context.
    let whole_prompts = crate::scheduler::prefills_whole_prompts(slots, spec.max_steps);
    let launch_tokens = if whole_prompts { max_context } else { limits.max_num_batched_tokens }.max(limits.max_num_batched_tokens).max(limits.max_num_seqs);
    let workspace = crate::kv::workspace_bytes(launch_tokens, spec.state_width.max(spec.hidden_size), limits.max_num_seqs, spec.vocab_size, model.device());
    let resident = limits.max_num_seqs.saturating_add(o.coda_reserve);
    // The state bank: a row per resident request and one for graph padding, for every scheduler
    // but the built-in CB (which keeps no state between launches).
    let row = (spec.state_width as u64).saturating_mul(spec.dtype.size_in_bytes() as u64);
    let bank_bytes = |rows: usize| if rows > 0 { (rows as u64 + 1).saturating_mul(row) } else { 0 };
    let cb = o.factory.is_none() && o.scheduler == SchedulerKind::Continuous;
    let bank_estimate = if cb { 0 } else { bank_bytes(resident) };
    // A request takes whole blocks in every slot.
    let useful = resident.saturating_mul(max_context.div_ceil(common.block_size).saturating_mul(common.block_size)).saturating_mul(slots);
    let num_blocks = common.pool_blocks(model.device(), slots, per_position, workspace.saturating_add(bank_estimate), useful)?;
    // Before the pool's bookkeeping or tensors exist: a pool given by hand that the device cannot
    // hold beside a launch's workspace and the state bank is an error, not an allocation that
    // aborts the process or a pool that fails every request at its first large launch. (One
    // sized from free memory left that room already.)
    let pool_tokens = num_blocks.saturating_mul(common.block_size);
    let pool_bytes = crate::kv::kv_bytes(pool_tokens, spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.dtype);
    let hint = "lower kv_capacity_tokens, kv_memory_fraction, max_num_seqs, max_num_batched_tokens or coda_reserve";
    let fitted = common.pool_fitted(model.device());
    if !fitted {
        crate::kv::check_fits(MemoryNeed { pool: pool_bytes, bank: bank_estimate, workspace }, hint, model.device())?;
    }
    let pool = KvPoolStats { blocks: num_blocks, block_size: common.block_size, slots, tokens: pool_tokens, bytes: pool_bytes.unwrap_or(u64::MAX) };
    let kv = KvManager::new(num_blocks, common.block_size, slots);
    let mut gate = match o.gate {
        Some(g) => g,
        None => Box::new(FixedDepth::new(spec.max_steps)?),
    };
    if gate.max_steps() > spec.max_steps {
        return Err(Error::InvalidOption(format!("exit gate allows {} steps but the model loops at most {} times", gate.max_steps(), spec.max_steps)));
    }
    if let Some(head) = gate.gate_head() {
        model.replace_gate_head(head)?;
    }
    if let Some(head) = gate.token_head() {
        let table = model.prelude_head_table(head)?;
        gate.install_token_table(table, spec.vocab_size)?;
    }
    // A custom scheduler may read the logits whatever gate it was handed.
    model.set_gate_logit(custom || gate.reads_gate_logit());
    // CB runs every token at full depth: a gate that would exit earlier would be ignored.
    if !custom && o.scheduler == SchedulerKind::Continuous && gate.min_steps() < spec.max_steps {
        return Err(Error::InvalidOption(
            "an exit gate that exits before full depth needs SchedulerKind::Depth or a custom scheduler (CB runs every token at full depth)".into(),
        ));
    }
    // Only the built-in depth scheduler holds a coda (a custom one holds its own).
    if o.min_coda_batch_size.is_some() && (custom || !matches!(o.scheduler, SchedulerKind::Depth { .. })) {
        return Err(Error::InvalidOption("min_coda_batch_size applies to the built-in depth scheduler (SchedulerKind::Depth)".into()));
    }
    let latent_diff = gate.reads_latent_diff();
    let scheduler: Box<dyn LoopedScheduler> = match (o.factory, o.scheduler) {
        (Some(f), _) => f(SchedulerContext { limits: limits.clone(), kv, layout, spec: spec.clone(), gate }),
        (None, SchedulerKind::Continuous) => Box::new(ContinuousBatching::new(limits.clone(), kv, layout, spec.max_steps)),
        (None, SchedulerKind::Depth { refill }) => {
            check_layout(layout.as_ref(), gate.min_steps(), gate.max_steps())?;
            let min_coda = o.min_coda_batch_size.unwrap_or(if spec.heavy_coda { (limits.max_num_seqs / 4).max(1) } else { 1 });
            if min_coda == 0 {
                return Err(Error::InvalidOption("min_coda_batch_size must be >= 1".into()));
            }
            let cfg = DepthConfig { refill, min_coda_batch_size: min_coda, coda_reserve: o.coda_reserve, ..DepthConfig::default() };
            Box::new(DepthBatching::new(cfg, limits.clone(), kv, layout, gate))
        }
    };
    // The bank the scheduler actually asks for (a custom one sizes its own): checked again where
    // it is larger than what was set aside for it.
    let bank_rows = scheduler.state_bank_rows();
    let bank = bank_bytes(bank_rows);
    if bank > bank_estimate {
        crate::kv::check_fits(MemoryNeed { pool: pool_bytes, bank, workspace }, hint, model.device())?;
    }
    let runner = LoopedRunner::with_cuda_graphs(model, num_blocks, common.block_size, bank_rows, o.cuda_graphs)?
        .with_launch_checks(custom)
        .with_graph_capture(o.graph_capture)
        .with_device_timing(o.time_device)
        .with_latent_diff(latent_diff);
    let half = LoopedHalf { runner, scheduler, overlap: false, in_flight: None };
    let mut engine = Engine::assemble(Family::Looped(Box::new(half)), tokenizer, eos, common.chat_template.take(), max_context, pool, common.kernels);
    engine.set_overlap(o.overlap)?;
    Ok(engine)
}

/// The diffusion half: one KV slot per layer, the block diffusion scheduler (or a custom one),
/// unmasking and eviction checked against the model.
fn build_diffusion(model: Box<dyn DiffusionModel>, tokenizer: Option<Tokenizer>, eos: Vec<u32>, o: DiffusionOptions, common: Common) -> Result<Engine> {
    let spec = model.spec().clone();
    let block_length = o.block_length.or(spec.block_length).unwrap_or(32);
    let max_context = common.max_context(spec.max_context);
    if block_length == 0 || block_length > max_context {
        return Err(Error::InvalidOption(format!("block length {block_length} must be in 1..={max_context}")));
    }
    if max_context % block_length != 0 {
        return Err(Error::InvalidOption(format!("block length {block_length} does not divide the context window {max_context} (blocks are aligned to it)")));
    }
    let max_steps = o.max_steps_per_block.unwrap_or(block_length);
    if max_steps == 0 {
        return Err(Error::InvalidOption("max_steps_per_block must be >= 1".into()));
    }
    // Dream's schedule runs every one of its steps, revealing nothing in most once they outnumber
    // the region's tokens; past the context window's positions a count is a mistake, not a schedule.
    if o.whole_region && max_steps > max_context {
        return Err(Error::InvalidOption(format!("Dream's sampler of {max_steps} steps: more than the {max_context} positions of the context window")));
    }
    let policy = match o.unmask {
        Some(p) => p,
        None => Box::new(Threshold::new(spec.unmask_threshold.unwrap_or(0.9))?),
    };
    let bidirectional = spec.attention == crate::diffusion::DiffusionAttention::Bidirectional;
    if !bidirectional && (o.cache.is_some() || o.whole_region) {
        return Err(Error::InvalidOption(format!(
            "`{}` is block-causal: its completed blocks are an exact prefix cache; canvas caches and Dream's sampler are for bidirectional models",
            spec.model_type
        )));
    }
    let cache = o.cache.unwrap_or_default();
    if bidirectional && cache == crate::diffusion::CanvasCache::Exact && o.delayed_cache {
        return Err(Error::InvalidOption("exact decoding recomputes the whole canvas every step; the delayed cache needs canvas_cache(Prefix or Dual)".into()));
    }
    let eviction = o.eviction.filter(|p| p.scores());
    if bidirectional && eviction.is_some() {
        return Err(Error::InvalidOption(format!("eviction (FOCUS) is supported for block-causal models, not `{}`", spec.model_type)));
    }
    if o.eviction_shadow && eviction.is_none() {
        return Err(Error::InvalidOption("eviction_shadow needs an eviction policy that scores tokens (e.g. Focus)".into()));
    }
    if let Some(p) = &eviction {
        if !o.eviction_shadow && !o.delayed_cache {
            return Err(Error::InvalidOption(format!("eviction policy {} needs the delayed cache (delayed_cache(true))", p.name())));
        }
        if spec.shift_logits {
            return Err(Error::InvalidOption(format!("eviction is not supported for shifted-logit models (`{}`)", spec.model_type)));
        }
        if spec.num_layers < 2 {
            return Err(Error::InvalidOption("eviction scores tokens at layers 0 and 1: the model needs two layers".into()));
        }
    }
    let limits = &common.limits;
    let per_position = crate::kv::kv_bytes(1, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype);
    // A bidirectional step row is its whole canvas: admission keeps a launch's canvases within the
    // budget, or one canvas up to the context. Dream's sampler reads out every masked position of
    // the generation; margin / entropy readouts hold about three times a probability readout's
    // logits.
    let budget = limits.max_num_batched_tokens;
    let launch_tokens = if bidirectional { budget.max(max_context) } else { budget.saturating_add(limits.max_num_seqs.saturating_mul(block_length + 1)) };
    let readout_rows = if o.whole_region { launch_tokens } else { limits.max_num_seqs.saturating_mul(block_length) };
    let readout_rows = readout_rows.saturating_mul(if policy.confidence() == crate::diffusion::Confidence::Probability { 1 } else { 3 });
    let workspace = crate::kv::workspace_bytes(launch_tokens, spec.hidden_size, readout_rows, spec.vocab_size, model.device());
    let rounded = max_context.div_ceil(block_length).saturating_mul(block_length);
    let useful = limits.max_num_seqs.saturating_mul(rounded.div_ceil(common.block_size).saturating_mul(common.block_size));
    let num_blocks = common.pool_blocks(model.device(), 1, per_position, workspace, useful)?;
    let pool_tokens = num_blocks.saturating_mul(common.block_size);
    let pool_bytes = crate::kv::kv_bytes(pool_tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype);
    let hint = "lower kv_capacity_tokens, kv_memory_fraction, max_num_seqs or max_num_batched_tokens";
    if !common.pool_fitted(model.device()) {
        crate::kv::check_fits(MemoryNeed { pool: pool_bytes, bank: 0, workspace }, hint, model.device())?;
    }
    let pool = KvPoolStats { blocks: num_blocks, block_size: common.block_size, slots: 1, tokens: pool_tokens, bytes: pool_bytes.unwrap_or(u64::MAX) };
    let kv = KvManager::new(num_blocks, common.block_size, 1);
    let cfg = DiffusionConfig {
        block_length,
        max_steps_per_block: max_steps,
        delayed_cache: o.delayed_cache,
        mask_token_id: spec.mask_token_id,
        attention: spec.attention,
        shift_logits: spec.shift_logits,
        eviction: eviction.is_some(),
        cache,
        whole_region: o.whole_region,
    };
    let confidence = policy.confidence();
    let limits = common.limits.clone();
    let custom = o.factory.is_some();
    let scheduler: Box<dyn DiffusionScheduler> = match o.factory {
        Some(f) => f(DiffusionSchedulerContext { limits: limits.clone(), kv, config: cfg, policy, spec: spec.clone() }),
        None => Box::new(DiffusionBatching::new(cfg, limits.clone(), kv, policy)),
    };
    let runner = DiffusionRunner::new(model, num_blocks, common.block_size, block_length)?
        .with_confidence(confidence)
        .with_launch_checks(custom)
        .with_eviction(eviction, o.eviction_shadow)
        .with_phase_timing(o.time_phases);
    let half = DiffusionHalf { runner, scheduler };
    Ok(Engine::assemble(Family::Diffusion(Box::new(half)), tokenizer, eos, common.chat_template, max_context, pool, common.kernels))
}
