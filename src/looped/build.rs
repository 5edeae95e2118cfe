//! Building a looped engine: the KV layout and exit gate checked against the model and the
//! scheduler, the pool and state bank sized against the device, the runner with CUDA graphs and
//! overlap as asked.

use super::executor::{LoopedExecutor, RankedRunners};
use super::gate::FixedDepth;
use super::layout::{check_layout, KvLayoutKind};
use super::models::LoopedModel;
use super::runner::LoopedRunner;
use super::{ContinuousBatching, DepthBatching, DepthConfig, LoopedHalf, LoopedOptions, LoopedScheduler, SchedulerContext, SchedulerKind};
use crate::engine::{Common, Engine, Family, KvPoolStats};
use crate::kv::{KvManager, MemoryNeed};
use crate::parallel::Shards;
use crate::scheduler::Requests;
use crate::{Error, Result};
use tokenizers::Tokenizer;

/// Most requests a looped engine may hold resident (`max_num_seqs` + `coda_reserve`).
const MAX_RESIDENT: usize = 1 << 20;

/// The looped half: KV layout and gate checked against the model and the scheduler, the state
/// bank sized by the scheduler, CUDA graphs and overlap as asked. With several shards (tensor
/// parallelism), a runner per rank on a thread of its own, each with the K/V of its heads;
/// the pool is sized on rank 0's device, whose share every rank's equals.
pub(crate) fn build(shards: Shards<Box<dyn LoopedModel>>, tokenizer: Option<Tokenizer>, eos: Vec<u32>, o: LoopedOptions, mut common: Common) -> Result<Engine> {
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
    let Shards { models: mut shard_models, comms, timeout } = shards;
    let model = &shard_models[0];
    let spec = model.spec().clone();
    let devices: Vec<candle_core::Device> = shard_models.iter().map(|m| m.device().clone()).collect();
    let max_context = common.max_context(spec.max_context);
    let layout = o.layout.unwrap_or_else(|| KvLayoutKind::default().build());
    crate::looped::layout::check_shape(layout.as_ref(), spec.max_steps)?;
    let slots = layout.num_slots(spec.max_steps);
    let per_position = crate::kv::kv_bytes(1, spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.dtype);
    // Layouts whose steps share a slot prefill a prompt whole, past the budget up to the context.
    let whole_prompts = super::admission::prefills_whole_prompts(slots, spec.max_steps);
    let launch_tokens = if whole_prompts { max_context } else { limits.max_num_batched_tokens }.max(limits.max_num_batched_tokens).max(limits.max_num_seqs);
    let resident = limits.max_num_seqs.saturating_add(o.coda_reserve);
    // The decode arena covers every launch a decode graph takes: up to the resident requests,
    // padded to their row bucket. Its buffers stay allocated beside a launch's workspace.
    let arena_rows = crate::looped::runner::graphs::row_bucket(resident).unwrap_or(resident);
    let decode_arena = common.kernels.decode_arena;
    let arena_bytes = if decode_arena { model.decode_arena_bytes(arena_rows) } else { 0 };
    let workspace = crate::kv::workspace_bytes(launch_tokens, spec.state_width.max(spec.hidden_size), limits.max_num_seqs, spec.vocab_size, model.device())
        .saturating_add(arena_bytes);
    // The state bank: a row per resident request and one for graph padding, for every scheduler
    // but the built-in CB (which keeps no state between launches).
    let row = (spec.state_width as u64).saturating_mul(spec.dtype.size_in_bytes() as u64);
    let bank_bytes = |rows: usize| if rows > 0 { (rows as u64 + 1).saturating_mul(row) } else { 0 };
    let cb = o.factory.is_none() && o.scheduler == SchedulerKind::Continuous;
    let bank_estimate = if cb { 0 } else { bank_bytes(resident) };
    // A request takes whole blocks in every slot.
    let useful = resident.saturating_mul(max_context.div_ceil(common.block_size).saturating_mul(common.block_size)).saturating_mul(slots);
    let num_blocks = common.pool_blocks_on(&devices, slots, per_position, workspace.saturating_add(bank_estimate), useful)?;
    // Before the pool's bookkeeping or tensors exist: a pool given by hand that the device cannot
    // hold beside a launch's workspace and the state bank is an error, not an allocation that
    // aborts the process or a pool that fails every request at its first large launch. (One
    // sized from free memory left that room already.)
    let pool_tokens = num_blocks.saturating_mul(common.block_size);
    let pool_bytes = crate::kv::kv_bytes(pool_tokens, spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.dtype);
    let hint = "lower kv_capacity_tokens, kv_memory_fraction, max_num_seqs, max_num_batched_tokens or coda_reserve";
    common.check_fits_on(&devices, MemoryNeed { pool: pool_bytes, bank: bank_estimate, workspace }, hint, false)?;
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
        for m in &mut shard_models {
            m.replace_gate_head(head)?;
        }
    }
    if let Some(head) = gate.token_head() {
        // The prelude (the embedding) is whole on every rank: rank 0's table is every rank's.
        let table = shard_models[0].prelude_head_table(head)?;
        gate.install_token_table(table, spec.vocab_size)?;
    }
    // A custom scheduler may read the logits whatever gate it was handed.
    for m in &mut shard_models {
        m.set_gate_logit(custom || gate.reads_gate_logit());
    }
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
        (Some(f), _) => f(SchedulerContext { limits: limits.clone(), layout, spec: spec.clone(), gate }),
        (None, SchedulerKind::Continuous) => Box::new(ContinuousBatching::new(limits.clone(), layout, spec.max_steps)),
        (None, SchedulerKind::Depth { refill }) => {
            check_layout(layout.as_ref(), gate.min_steps(), gate.max_steps())?;
            let min_coda = o.min_coda_batch_size.unwrap_or(if spec.heavy_coda { (limits.max_num_seqs / 4).max(1) } else { 1 });
            if min_coda == 0 {
                return Err(Error::InvalidOption("min_coda_batch_size must be >= 1".into()));
            }
            let cfg = DepthConfig { refill, min_coda_batch_size: min_coda, coda_reserve: o.coda_reserve, ..DepthConfig::default() };
            Box::new(DepthBatching::new(cfg, limits.clone(), layout, gate))
        }
    };
    // The bank the scheduler actually asks for (a custom one sizes its own): checked again where
    // it is larger than what was set aside for it.
    let bank_rows = scheduler.state_bank_rows();
    let bank = bank_bytes(bank_rows);
    if bank > bank_estimate {
        common.check_fits_on(&devices, MemoryNeed { pool: pool_bytes, bank, workspace }, hint, true)?;
    }
    let runner = |model| -> Result<LoopedRunner> {
        let mut runner = LoopedRunner::with_cuda_graphs(model, num_blocks, common.block_size, bank_rows, o.cuda_graphs)?
            .with_launch_checks(custom)
            .with_graph_capture(o.graph_capture)
            .with_device_timing(o.time_device)
            .with_latent_diff(latent_diff);
        if decode_arena {
            runner.install_decode_arena(arena_rows)?;
        }
        Ok(runner)
    };
    let runner = if shard_models.len() == 1 {
        LoopedExecutor::One(runner(shard_models.pop().expect("one shard"))?)
    } else {
        let runners = shard_models.into_iter().map(runner).collect::<Result<Vec<_>>>()?;
        LoopedExecutor::Ranks(RankedRunners::new(runners, comms, timeout)?)
    };
    let half = LoopedHalf { runner, scheduler, overlap: false, in_flight: None };
    let mut engine =
        Engine::assemble(Family::Looped(Box::new(half)), Requests::new(kv), tokenizer, eos, common.chat_template.take(), max_context, pool, common.kernels);
    engine.set_overlap(o.overlap)?;
    Ok(engine)
}
