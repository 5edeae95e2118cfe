//! Building a diffusion engine: block length, unmasking and eviction checked against the model,
//! the pool sized against the device, the block-diffusion scheduler (or a custom one) and the
//! runner.

use super::executor::DiffusionExecutor;
use super::models::DiffusionModel;
use super::runner::DiffusionRunner;
use super::EvictionPolicy;
use super::{DiffusionBatching, DiffusionConfig, DiffusionHalf, DiffusionOptions, DiffusionScheduler, DiffusionSchedulerContext, Threshold};
use crate::engine::{Common, Engine, Family, KvPoolStats};
use crate::kv::{KvManager, MemoryNeed};
use crate::parallel::{Ranks, Shards};
use crate::scheduler::Requests;
use crate::{Error, Result};
use std::sync::Arc;
use tokenizers::Tokenizer;

/// The diffusion half: one KV slot per layer, the block diffusion scheduler (or a custom one),
/// unmasking and eviction checked against the model.
///
/// With several shards (tensor parallelism), a runner per rank on a thread of its own; the pool
/// is sized on rank 0's device, whose share every rank's equals.
pub(crate) fn build(
    shards: Shards<Box<dyn DiffusionModel>>,
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
    o: DiffusionOptions,
    common: Common,
) -> Result<Engine> {
    let Shards { models, comms, timeout } = shards;
    let model = &models[0];
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
    let devices: Vec<candle_core::Device> = models.iter().map(|m| m.device().clone()).collect();
    let num_blocks = common.pool_blocks_on(&devices, 1, per_position, workspace, useful)?;
    let pool_tokens = num_blocks.saturating_mul(common.block_size);
    let pool_bytes = crate::kv::kv_bytes(pool_tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype);
    let hint = "lower kv_capacity_tokens, kv_memory_fraction, max_num_seqs or max_num_batched_tokens";
    common.check_fits_on(&devices, MemoryNeed { pool: pool_bytes, bank: 0, workspace }, hint, false)?;
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
        Some(f) => f(DiffusionSchedulerContext { limits: limits.clone(), config: cfg, policy, spec: spec.clone() }),
        None => Box::new(DiffusionBatching::new(cfg, limits.clone(), policy)),
    };
    let eviction: Option<Arc<dyn EvictionPolicy>> = eviction.map(Arc::from);
    let runner = |model| -> Result<DiffusionRunner> {
        Ok(DiffusionRunner::new(model, num_blocks, common.block_size, block_length)?
            .with_confidence(confidence)
            .with_launch_checks(custom)
            .with_eviction(eviction.clone(), o.eviction_shadow)
            .with_phase_timing(o.time_phases))
    };
    let mut models = models;
    let runner = if models.len() == 1 {
        DiffusionExecutor::One(runner(models.pop().expect("one shard"))?)
    } else {
        let runners = models.into_iter().map(runner).collect::<Result<Vec<_>>>()?;
        // Tensors the builder made on this thread are ready before another thread uses them.
        for r in &runners {
            r.model().device().synchronize()?;
        }
        // Before the group is rebuilt after a failure, the device's queue is drained of what the
        // failed launch left.
        let on_reset: crate::parallel::OnReset<DiffusionRunner> = Arc::new(|runner: &mut DiffusionRunner| {
            let _ = runner.model().device().synchronize();
        });
        DiffusionExecutor::Ranks { ranks: Ranks::spawn(runners, comms, timeout, Some(on_reset))?, spec: spec.clone(), phases: Vec::new() }
    };
    let half = DiffusionHalf { runner, scheduler };
    Ok(Engine::assemble(Family::Diffusion(Box::new(half)), Requests::new(kv), tokenizer, eos, common.chat_template, max_context, pool, common.kernels))
}
