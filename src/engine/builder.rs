//! Configuring and building an [`Engine`]: options every model takes live here; options of one
//! family live in [`LoopedOptions`] / [`DiffusionOptions`], and each family builds its half
//! (`looped/build.rs`, `diffusion/build.rs`).

use super::{Engine, EngineHandle};
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::diffusion::models::DiffusionModel;
use crate::diffusion::DiffusionOptions;
use crate::loader::ModelDir;
use crate::looped::models::{Huginn, LoopedModel, Ouro};
use crate::looped::LoopedOptions;
use crate::ops::{AttentionKernels, KernelPolicy};
use crate::quant::Quantization;
use crate::scheduler::SchedulerLimits;
use crate::{Error, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;
use std::time::Duration;
use tokenizers::Tokenizer;

/// Options every engine takes, whatever the model family.
pub(crate) struct Common {
    pub(crate) device: Device,
    pub(crate) dtype: DType,
    pub(crate) limits: SchedulerLimits,
    pub(crate) block_size: usize,
    pub(crate) kv_tokens: Option<usize>,
    pub(crate) kv_fraction: Option<f64>,
    pub(crate) max_model_len: Option<usize>,
    pub(crate) kernels: KernelPolicy,
    pub(crate) chat_template: Option<ChatTemplate>,
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

    pub(crate) fn max_context(&self, model_max: usize) -> usize {
        self.max_model_len.map_or(model_max, |m| m.min(model_max))
    }

    /// Blocks of the KV pool, sized before anything is allocated (see [`EngineBuilder::kv_memory_fraction`]):
    /// `slots` cache slots whose positions take `bytes_per_position` each, `useful` positions at
    /// most (what the resident requests can fill), and `reserved` bytes kept free beside it (a
    /// launch's workspace and the state bank). A count given by hand is rounded up to whole
    /// blocks; one sized from free memory down, so that it stays within what it was sized from.
    pub(crate) fn pool_blocks(&self, device: &Device, slots: usize, bytes_per_position: Option<u64>, reserved: u64, useful: usize) -> Result<usize> {
        let per_position = bytes_per_position.ok_or_else(|| Error::InvalidOption("the KV pool's size overflows 64 bits".into()))?;
        let sizing = crate::kv::PoolSizing { tokens: self.kv_tokens, fraction: self.kv_fraction };
        let tokens = sizing.pool_tokens(device, slots, per_position, reserved, useful)?;
        Ok(if self.pool_fitted(device) { (tokens / self.block_size).max(slots) } else { tokens.div_ceil(self.block_size) })
    }

    /// [`Common::pool_blocks`] for ranks on `devices`, each with its own pool of the same
    /// size: the fewest blocks any rank's device can hold. Ranks on the CPU share one memory,
    /// so their positions and reserves count once per rank there.
    pub(crate) fn pool_blocks_on(&self, devices: &[Device], slots: usize, bytes_per_position: Option<u64>, reserved: u64, useful: usize) -> Result<usize> {
        let share = sharing(devices);
        let per_position = bytes_per_position.map(|b| b.saturating_mul(share));
        let mut blocks = usize::MAX;
        for device in distinct(devices) {
            blocks = blocks.min(self.pool_blocks(device, slots, per_position, reserved.saturating_mul(share), useful)?);
        }
        Ok(blocks)
    }

    /// `kv::check_fits` on every rank's device (CPU ranks' needs together), unless the pool
    /// was sized from its free memory (which left room already) and `always` is off.
    pub(crate) fn check_fits_on(&self, devices: &[Device], need: crate::kv::MemoryNeed, hint: &str, always: bool) -> Result<()> {
        let share = sharing(devices);
        let need = crate::kv::MemoryNeed {
            pool: need.pool.map(|p| p.saturating_mul(share)),
            bank: need.bank.saturating_mul(share),
            workspace: need.workspace.saturating_mul(share),
        };
        for device in distinct(devices) {
            if always || !self.pool_fitted(device) {
                crate::kv::check_fits(need, hint, device)?;
            }
        }
        Ok(())
    }

    /// Whether the pool is sized from the device's free memory (already leaving room for what
    /// `pool_blocks` reserved) rather than given by hand or fixed.
    pub(crate) fn pool_fitted(&self, device: &Device) -> bool {
        self.kv_tokens.is_none() && (self.kv_fraction.is_some() || device.is_cuda())
    }
}

/// How many ranks share one device's memory: all of them on the CPU, one a GPU.
fn sharing(devices: &[Device]) -> u64 {
    if devices.iter().all(Device::is_cpu) {
        devices.len().max(1) as u64
    } else {
        1
    }
}

/// Each device once.
fn distinct(devices: &[Device]) -> Vec<&Device> {
    let mut out: Vec<&Device> = Vec::new();
    for d in devices {
        if !out.iter().any(|o| o.same_device(d)) {
            out.push(d);
        }
    }
    out
}

/// A model directory (or a config with weights made per device), with options for whichever
/// family its checkpoint turns out to be.
pub struct Checkpoint {
    origin: Origin,
    looped: Option<LoopedOptions>,
    diffusion: Option<DiffusionOptions>,
    quantization: Quantization,
    tensor_parallel: usize,
    /// The ranks' devices, when given one by one (`tensor_parallel_on`).
    rank_devices: Option<Vec<Device>>,
    expert_parallel: bool,
    collective_timeout: Duration,
}

/// Where a checkpoint's config, weights and tokenizer come from.
enum Origin {
    Dir(PathBuf),
    /// A config and the weights for a device, made as the model reads them (each rank of a
    /// tensor-parallel group gets its own `Weights`).
    Weights(Box<InMemoryWeights>),
}

struct InMemoryWeights {
    config: ModelConfig,
    weights: WeightsFor,
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
}

/// The weights of a model on one device (`EngineBuilder::from_weights`).
pub type WeightsFor = Box<dyn Fn(&Device, DType) -> Result<crate::loader::Weights> + Send>;

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
        Self::from_origin(Origin::Dir(path.into()))
    }

    /// An engine for the model `config` describes, its weights made for each device by
    /// `weights(device, dtype)` (a [`crate::loader::Weights::lazy`] source makes only what a
    /// rank keeps). Like a checkpoint directory otherwise: both families, tensor parallelism,
    /// quantization. Released shapes with random weights are how the GPU benchmarks run models
    /// they cannot download.
    pub fn from_weights(
        config: ModelConfig,
        weights: impl Fn(&Device, DType) -> Result<crate::loader::Weights> + Send + 'static,
        tokenizer: Option<Tokenizer>,
        eos: Vec<u32>,
    ) -> Self {
        Self::from_origin(Origin::Weights(Box::new(InMemoryWeights { config, weights: Box::new(weights), tokenizer, eos })))
    }

    fn from_origin(origin: Origin) -> Self {
        let source = Checkpoint {
            origin,
            looped: None,
            diffusion: None,
            quantization: Quantization::None,
            tensor_parallel: 1,
            rank_devices: None,
            expert_parallel: false,
            collective_timeout: Duration::from_secs(300),
        };
        Self::with_source(source, Device::Cpu, DType::F32)
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

    /// Stores the linear layers quantized, from the checkpoint's own precision at load
    /// ([`Quantization::Fp8`]: attention projections and MLPs in E4M3 with a scale per output
    /// channel, MoE experts too; embeddings, norms, routers, exit gates and the LM head as they
    /// are).
    pub fn quantization(mut self, q: Quantization) -> Self {
        self.source.quantization = q;
        self
    }

    /// Splits the model over `n` devices (tensor parallelism): each rank holds `1/n` of every
    /// layer's attention heads (with their K/V cache) and MLP columns and sums its partial
    /// outputs with the others' in one all-reduce per block. On the CPU the ranks are threads of
    /// this process; on CUDA they are the `n` GPUs from the builder's device's ordinal on, joined
    /// by NCCL. Heads, K/V heads and MLP widths must divide by `n`. Default 1.
    pub fn tensor_parallel(mut self, n: usize) -> Self {
        self.source.tensor_parallel = n;
        self.source.rank_devices = None;
        self
    }

    /// [`EngineBuilder::tensor_parallel`] over the given devices, rank r on `devices[r]`: all
    /// CPU, or distinct GPUs (`[Device::new_cuda(2)?, Device::new_cuda(3)?]`). Rank 0's device
    /// is the engine's.
    pub fn tensor_parallel_on(mut self, devices: Vec<Device>) -> Self {
        self.source.tensor_parallel = devices.len();
        if let Some(first) = devices.first() {
            self.common.device = first.clone();
        }
        self.source.rank_devices = Some(devices);
        self
    }

    /// With [`EngineBuilder::tensor_parallel`] over a mixture-of-experts model (LLaDA2.0,
    /// SDAR-MoE): splits the routed experts over the ranks whole — each rank holds `E/n` experts
    /// and computes only the routes to them — instead of every expert's columns (the default,
    /// which keeps the work even however the router chooses). Either way the router runs on
    /// every rank alike and one all-reduce per layer combines the parts: the ranks' hidden
    /// states are already the same after attention, so no all-to-all dispatch is needed. The
    /// experts must divide by `n`.
    pub fn expert_parallel(mut self, on: bool) -> Self {
        self.source.expert_parallel = on;
        self
    }

    /// How long a rank waits in a collective for the others before the launch fails on every
    /// rank (a rank that died or hangs ends the launch with [`Error::Collective`], not a
    /// hung engine). Default 300 s: room for a first launch's kernel compilation and graph
    /// capture.
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.source.collective_timeout = timeout;
        self
    }

    /// Loads the model and allocates the KV cache.
    pub fn build(self) -> Result<Engine> {
        let Self { source, mut common } = self;
        common.check()?;
        if source.tensor_parallel == 0 {
            return Err(Error::InvalidOption("tensor_parallel must be >= 1".into()));
        }
        if source.expert_parallel && source.tensor_parallel == 1 {
            return Err(Error::InvalidOption("expert_parallel splits experts over tensor_parallel ranks: set tensor_parallel(n) with n >= 2".into()));
        }
        let (config, weights_for, tokenizer, eos): (ModelConfig, WeightsFor, _, _) = match source.origin {
            Origin::Dir(path) => {
                let dir = ModelDir::open(&path)?;
                if common.chat_template.is_none() {
                    common.chat_template = dir.chat()?;
                }
                let (config, tokenizer, eos) = (dir.config.clone(), dir.tokenizer()?, dir.eos_token_ids.clone());
                (config, Box::new(move |device: &Device, dtype| dir.weights(dtype, device)), tokenizer, eos)
            }
            Origin::Weights(w) => (w.config, w.weights, w.tokenizer, w.eos),
        };
        let looped_model = matches!(config, ModelConfig::Ouro(_) | ModelConfig::Huginn(_));
        // The one place a wrong-family option is refused: before any weight is read.
        let wrong = |options, family| Err(Error::WrongFamily { options, model_type: config.model_type().into(), family });
        match (looped_model, &source.looped, &source.diffusion) {
            (true, _, Some(_)) => return wrong("diffusion", "looped"),
            (false, Some(_), _) => return wrong("looped", "diffusion"),
            _ => {}
        }
        let devices = match source.rank_devices {
            Some(d) if d.first().is_some_and(|first| !first.same_device(&common.device)) => {
                return Err(Error::InvalidOption(format!(
                    "tensor_parallel_on puts rank 0 on {:?}, but the engine's device was set to {:?} after it",
                    d[0], common.device
                )));
            }
            Some(d) => crate::parallel::check_rank_devices(d)?,
            None => crate::parallel::rank_devices(&common.device, source.tensor_parallel)?,
        };
        let comms = crate::parallel::group(&devices, source.collective_timeout)?;
        let weights = |device: &Device| -> Result<crate::loader::Weights> { Ok(weights_for(device, common.dtype)?.with_quantization(source.quantization)) };
        // Rank r's share of the model, on its device (the whole model without parallelism).
        let rank = |r: usize| comms.get(r).map(|c| Ok::<_, Error>((crate::parallel::TpRank::new(r, devices.len())?, c.clone()))).transpose();
        if source.expert_parallel && (looped_model || !crate::diffusion::models::has_experts(&config)) {
            return Err(Error::InvalidOption(format!("expert_parallel: `{}` has no mixture-of-experts layers", config.model_type())));
        }
        if !looped_model {
            let mut models = Vec::with_capacity(devices.len());
            for (r, device) in devices.iter().enumerate() {
                let w = weights(device)?;
                let model = match rank(r)? {
                    Some((rank, comm)) => crate::diffusion::models::load_shard(&config, &w, rank, comm, source.expert_parallel)?,
                    None => crate::diffusion::models::load(&config, &w)?,
                };
                models.push(Box::new(model) as Box<dyn DiffusionModel>);
            }
            let shards = crate::parallel::Shards { models, comms, timeout: source.collective_timeout };
            return crate::diffusion::build::build(shards, tokenizer, eos, source.diffusion.unwrap_or_default(), common);
        }
        let mut options = source.looped.unwrap_or_default();
        // Huginn's option, taken for its load; left for the build to refuse on any other model.
        let init = if matches!(config, ModelConfig::Huginn(_)) { options.initial_state.take() } else { None };
        let mut models = Vec::with_capacity(devices.len());
        for (r, device) in devices.iter().enumerate() {
            let w = weights(device)?;
            let rank = rank(r)?;
            let model: Box<dyn LoopedModel> = match (&config, rank) {
                (ModelConfig::Huginn(c), rank) => {
                    let huginn = match rank {
                        Some((rank, comm)) => Huginn::load_shard(c, &w, rank, comm)?,
                        None => Huginn::load(c, &w)?,
                    };
                    Box::new(huginn.with_initial_state(init.unwrap_or_default())?)
                }
                (ModelConfig::Ouro(c), Some((rank, comm))) => Box::new(Ouro::load_shard(c, &w, rank, comm)?),
                (ModelConfig::Ouro(c), None) => Box::new(Ouro::load(c, &w)?),
                (other, _) => return Err(Error::UnsupportedModel(other.model_type().into())),
            };
            models.push(model);
        }
        crate::looped::build::build(crate::parallel::Shards { models, comms, timeout: source.collective_timeout }, tokenizer, eos, options, common)
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
        crate::looped::build::build(crate::parallel::Shards::one(s.model), s.tokenizer, s.eos, s.options, common)
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
        crate::diffusion::build::build(crate::parallel::Shards::one(s.model), s.tokenizer, s.eos, s.options, common)
    }
    /// Builds the engine on its own thread and returns a handle that many threads can use.
    pub fn spawn(self) -> Result<EngineHandle> {
        EngineHandle::spawn(move || self.build())
    }
}
