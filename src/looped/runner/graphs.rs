//! CUDA-graph replay of the decode hot path (core steps, full-depth decode, coda).
//!
//! At decode widths a launch is host-bound: hundreds of candle ops, each ~10 µs of host time,
//! for a few ms of GPU work. So the runner captures each decode shape once and replays it:
//!
//! - A launch's rows are padded up to a **row bucket** ([`ROW_BUCKETS`]); padding rows read and
//!   write only a scratch KV block and a scratch state-bank row that no request owns.
//! - Every tensor a captured launch reads from the host side lives in static buffers of its
//!   [`GraphKey`] ([`Statics`]): token ids, positions, state rows, and per cache slot the paged
//!   addressing ([`PagedBatchBuffers`], block tables padded to the context bucket). They are
//!   overwritten (one host-to-device copy each) before every replay.
//! - Outputs read after the launch (gate logits, latent change, logits) are copied inside the
//!   graph into static output tensors; the new hidden states go to the state bank in place.
//! - The attention kernel bakes `max_context_len` into its launch shape, so it is part of the
//!   key as the **context bucket** (the next power of two, at least 256).
//! - First use of a key runs the same code eagerly with candle's graph host-to-device cache
//!   on (a warm-up that fills the cache of kernel parameter arrays and is itself the launch);
//!   the second use captures and replays; later uses only replay. A failed capture is logged
//!   once and that key runs eagerly from then on.

use crate::looped::Stage;
use crate::ops::{write_u32, PagedBatchBuffers};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::HashMap;

/// Row counts a launch is padded up to. Powers of two while launches are weight-bound, then
/// steps of 16 and 32 rows: from ~128 rows a launch is compute-bound, and depth batching's
/// launches take any width (a 332-row core step padded to 384 rows wasted 16 % of its FLOPs).
pub const ROW_BUCKETS: [usize; 24] = [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480, 512];

/// The smallest bucket holding `rows`, or `None` when a launch is too wide for any.
pub fn row_bucket(rows: usize) -> Option<usize> {
    ROW_BUCKETS.iter().copied().find(|&b| b >= rows)
}

/// The context bucket of a launch whose longest row sees `max_ctx` keys.
pub fn ctx_bucket(max_ctx: usize) -> usize {
    max_ctx.max(1).next_power_of_two().max(256)
}

/// What one captured graph is specialised to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub stage: Stage,
    /// Padded row count.
    pub rows: usize,
    /// Context bucket (0 for the coda, which has no attention).
    pub ctx: usize,
    /// Cache slot of each loop step (full-depth launches); empty otherwise.
    pub slots: Vec<usize>,
    /// Coda launches with eager re-entry whose rows all decode greedily: the graph also takes
    /// the argmax and runs the successors' prelude into the state bank.
    pub reenter: bool,
}

fn align4(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// Static device inputs and outputs of one [`GraphKey`].
pub struct Statics {
    inputs: Tensor,
    /// `[rows]` u32 token ids (full-depth decode).
    pub tokens: Tensor,
    /// `[rows]` u32 absolute positions.
    pub positions: Tensor,
    /// `[rows]` u32 state-bank rows (padding: the scratch row).
    pub state: Tensor,
    /// `[rows]` u32 positions of the re-entered successors (re-entering coda).
    pub next_positions: Tensor,
    /// `[rows]` u32 greedy ids (re-entering coda).
    pub ids: Option<Tensor>,
    /// Paged addressing of the re-entered successors (re-entering coda).
    pub reentry: Option<PagedBatchBuffers>,
    /// Paged addressing per distinct cache slot, in first-use order (one for core steps, whose
    /// rows each bring their own slot's table; none for the coda).
    pub batches: Vec<(usize, PagedBatchBuffers)>,
    /// `[steps, rows]` f32 gate logits (one step for core steps).
    pub gate: Tensor,
    /// `[rows]` f32 relative latent change (core steps).
    pub latent: Tensor,
    /// `[rows, vocab]` f32 logits (full-depth decode, coda).
    pub logits: Option<Tensor>,
    /// Whether the model produced gate logits (known after the warm-up).
    pub has_gate: bool,
}

impl Statics {
    pub fn new(key: &GraphKey, vocab: usize, block_size: usize, device: &Device) -> Result<Self> {
        let b = key.rows;
        let inputs = Tensor::zeros(4 * align4(b), DType::U32, device)?;
        let view = |i: usize| inputs.narrow(0, i * align4(b), b);
        let (tokens, positions, state, next_positions) = (view(0)?, view(1)?, view(2)?, view(3)?);
        let max_blocks = key.ctx.div_ceil(block_size);
        let mut batches = Vec::new();
        if key.ctx > 0 {
            let slots: Vec<usize> = if key.slots.is_empty() { vec![0] } else { key.slots.clone() };
            for s in slots {
                if !batches.iter().any(|(t, _)| *t == s) {
                    batches.push((s, PagedBatchBuffers::new(b, b, max_blocks, device)?));
                }
            }
        }
        let logits = (key.stage != Stage::CoreStep).then(|| Tensor::zeros((b, vocab), DType::F32, device)).transpose()?;
        let reentry = key.reenter.then(|| PagedBatchBuffers::new(b, b, max_blocks.max(1), device)).transpose()?;
        Ok(Self {
            inputs: inputs.clone(),
            tokens,
            positions,
            state,
            next_positions,
            ids: key.reenter.then(|| Tensor::zeros(b, DType::U32, device)).transpose()?,
            reentry,
            batches,
            gate: Tensor::zeros((key.slots.len().max(1), b), DType::F32, device)?,
            latent: Tensor::zeros(b, DType::F32, device)?,
            logits,
            has_gate: false,
        })
    }

    /// Writes the per-row inputs, padded: token 0, position 0, state row `pad_state`
    /// (`next_positions` only for a re-entering coda, else empty).
    pub fn write_inputs(&self, tokens: &[u32], positions: &[u32], next_positions: &[u32], state: &[u32], pad_state: u32) -> Result<()> {
        let b = self.tokens.dim(0)?;
        let mut words = vec![0u32; self.inputs.elem_count()];
        let a = align4(b);
        words[..tokens.len()].copy_from_slice(tokens);
        words[a..a + positions.len()].copy_from_slice(positions);
        words[2 * a..3 * a].fill(pad_state);
        words[2 * a..2 * a + state.len()].copy_from_slice(state);
        words[3 * a..3 * a + next_positions.len()].copy_from_slice(next_positions);
        write_u32(&self.inputs, &words)
    }
}

/// Where a key stands.
pub enum Phase {
    /// Created; the next use runs eagerly as the warm-up.
    New,
    /// Warmed up; the next use captures.
    Warm,
    Ready(Graph),
    /// Capture failed: this key runs eagerly.
    Failed,
}

pub struct Entry {
    pub statics: Statics,
    pub phase: Phase,
}

/// The runner's graphs, keyed by shape.
#[derive(Default)]
pub struct GraphCache {
    pub entries: HashMap<GraphKey, Entry>,
    /// A capture failure was reported (reported once).
    pub warned: bool,
    pub captures: usize,
    pub replays: usize,
    /// The captured graphs' nodes.
    pub nodes: crate::looped::metrics::GraphNodes,
    /// cuBLAS's workspace for every capture (made with the runner on CUDA).
    pub workspace: Option<std::sync::Arc<GemmWorkspace>>,
}

/// An instantiated CUDA graph, and the cuBLAS workspace its products were captured with.
#[cfg(feature = "cuda")]
pub struct Graph {
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    _workspace: std::sync::Arc<GemmWorkspace>,
}

/// cuBLAS's workspace during captures (`ops::cuda::GemmWorkspace`); one serves every graph of a
/// runner, since they replay one at a time on its stream.
#[cfg(feature = "cuda")]
pub use crate::ops::cuda::GemmWorkspace;

/// No cuBLAS workspace without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub enum GemmWorkspace {}

#[cfg(not(feature = "cuda"))]
impl GemmWorkspace {
    pub fn new(device: &Device) -> Result<Self> {
        candle_core::bail!("cuBLAS workspace on {device:?} without the `cuda` feature")
    }
}

// SAFETY: a graph is used by one thread at a time (the runner's owner); CUDA graph execs may
// be launched from any thread when calls are serialised.
#[cfg(feature = "cuda")]
unsafe impl Send for Graph {}

/// No graphs without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub enum Graph {}

#[cfg(feature = "cuda")]
impl Graph {
    /// Captures what `body` enqueues on `device`'s stream (nothing runs) and instantiates it,
    /// cuBLAS working in `workspace` (so that its products add no memory nodes). `body` must
    /// drop every tensor it allocates before returning, and must not read device data on the
    /// host. On error the capture is ended and discarded.
    pub fn capture(device: &Device, workspace: &std::sync::Arc<GemmWorkspace>, body: impl FnOnce() -> Result<()>) -> Result<Self> {
        use candle_core::cuda_backend::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        use candle_core::cuda_backend::WrapErr;
        let Device::Cuda(dev) = device else {
            candle_core::bail!("CUDA graph capture on {device:?}");
        };
        let stream = dev.cuda_stream();
        let ctx = stream.context().clone();
        ctx.check_err().w()?;
        let _cache = dev.enable_cuda_graph_htod_cache();
        let graph = workspace.lend(device, || {
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).w()?;
            let res = body();
            let graph = stream.end_capture(CUgraphInstantiate_flags(0));
            // Errors of asynchronous frees during the capture are only recorded; surface them.
            let recorded = ctx.check_err();
            res?;
            recorded.w()?;
            graph.w()
        })?;
        let graph = graph.ok_or_else(|| candle_core::Error::Msg("CUDA graph capture recorded nothing".into()))?;
        graph.upload().w()?;
        Ok(Self { graph, _workspace: workspace.clone() })
    }

    pub fn launch(&self) -> Result<()> {
        use candle_core::cuda_backend::WrapErr;
        self.graph.launch().w()
    }

    /// The graph's nodes by kind.
    pub fn nodes(&self) -> Result<crate::looped::metrics::GraphNodes> {
        use candle_core::cuda_backend::cudarc::driver::sys::{self, CUgraphNodeType};
        use candle_core::cuda_backend::WrapErr;
        let graph = self.graph.cu_graph();
        let mut count = 0usize;
        // SAFETY: `graph` is this capture's graph, alive while `self` is; a null node array asks
        // only for the count, then the array holds `count` nodes.
        unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }.result().w()?;
        let mut nodes = vec![std::ptr::null_mut(); count];
        unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) }.result().w()?;
        let mut out = crate::looped::metrics::GraphNodes::default();
        for &node in &nodes[..count] {
            let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node of this graph, listed just above.
            unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result().w()?;
            match kind {
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => out.kernels += 1,
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC | CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => out.memory += 1,
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY | CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => out.copies += 1,
                _ => out.other += 1,
            }
        }
        Ok(out)
    }

    /// Runs `body` eagerly with candle's host-to-device parameter cache on. A body must run once
    /// this way before it is captured: kernels on strided tensors upload their shape/stride
    /// vectors, which a capture cannot do, so during capture they read them from this cache.
    pub fn warm_up<R>(device: &Device, body: impl FnOnce() -> Result<R>) -> Result<R> {
        let _cache = match device {
            Device::Cuda(d) => Some(d.enable_cuda_graph_htod_cache()),
            _ => None,
        };
        body()
    }
}

#[cfg(not(feature = "cuda"))]
impl Graph {
    pub fn capture(device: &Device, _workspace: &std::sync::Arc<GemmWorkspace>, _body: impl FnOnce() -> Result<()>) -> Result<Self> {
        candle_core::bail!("CUDA graph capture on {device:?} without the `cuda` feature")
    }

    pub fn nodes(&self) -> Result<crate::looped::metrics::GraphNodes> {
        match *self {}
    }

    /// Without the `cuda` feature there is no cache to fill: runs `body`.
    pub fn warm_up<R>(_device: &Device, body: impl FnOnce() -> Result<R>) -> Result<R> {
        body()
    }

    pub fn launch(&self) -> Result<()> {
        match *self {}
    }
}

thread_local! {
    /// Tests only: runners built on this thread with graphs on also use the graph path on the
    /// CPU, where every launch runs the graph body eagerly over the padded static buffers (it
    /// never captures). This checks the padding and buffer plumbing against the eager path.
    pub(crate) static CPU_GRAPH_BODIES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Turns the context's event tracking off: with one stream per device it orders nothing, and
/// its per-launch event waits cannot be captured. Called when a runner enables graphs.
pub fn prepare_device(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        // SAFETY: candle queues all work of a device on its one stream, so stream order alone
        // orders every read and write; events only matter across streams.
        unsafe { dev.disable_event_tracking() };
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        assert_eq!(row_bucket(1), Some(1));
        assert_eq!(row_bucket(3), Some(4));
        assert_eq!(row_bucket(33), Some(48));
        assert_eq!(row_bucket(512), Some(512));
        assert_eq!(row_bucket(513), None);
        assert_eq!(ctx_bucket(1), 256);
        assert_eq!(ctx_bucket(256), 256);
        assert_eq!(ctx_bucket(257), 512);
    }

    /// Graph bodies over padded buffers give exactly the eager tokens (f32, CPU), for CB with
    /// a slot per step and for depth refill with a shared slot and a replayed exit trace.
    #[test]
    fn graph_bodies_match_eager_on_cpu() {
        use crate::looped::gate::{DepthTrace, Replay};
        use crate::looped::models::Huginn;
        use crate::looped::models::LoopedModel;
        use crate::looped::models::Ouro;
        use crate::{EngineBuilder, Event, GenerationParams, KvLayoutKind, SchedulerKind};
        let cfg = crate::testing::tiny_ouro_config(97);
        let weights = crate::testing::random_ouro_weights(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
        let ouro = Ouro::load(&cfg, &weights).unwrap();
        // Huginn: a prelude with attention, so the re-entering coda graph writes K/V too.
        let hcfg = crate::testing::tiny_huginn_config(97);
        let mut t = crate::testing::random_tensors(&crate::testing::huginn_tensor_manifest(&hcfg), 4, DType::F32, &Device::Cpu).unwrap();
        let wte = t["transformer.wte.weight"].clone();
        t.insert("lm_head.weight".into(), wte);
        let huginn = Huginn::load(&hcfg, &crate::loader::Weights::from_map(t, DType::F32, &Device::Cpu)).unwrap();
        let prompts: Vec<Vec<u32>> = (0..11u32).map(|i| (0..1 + (i * 7) % 23).map(|j| (i * 31 + j * 17) % 97).collect()).collect();
        let new_tokens: Vec<usize> = (0..11).map(|i| 2 + (i * 5) % 13).collect();
        let run_with = |model: Box<dyn LoopedModel>,
                        sched: SchedulerKind,
                        layout: KvLayoutKind,
                        width: usize,
                        graphs: bool,
                        kernels: crate::ops::KernelPolicy,
                        q_exit: bool| {
            CPU_GRAPH_BODIES.with(|c| c.set(graphs));
            let mut b = EngineBuilder::from_model(model, None, vec![])
                .kernels(kernels)
                .looped(|o| o.scheduler(sched).kv_layout(layout))
                .max_num_seqs(width)
                .block_size(4)
                .max_num_batched_tokens(256)
                .looped(|o| o.cuda_graphs(graphs));
            if q_exit {
                // Ouro's own exit gate: the core steps compute its logit, read every step.
                b = b.looped(|o| o.exit_gate(crate::looped::gate::QExit::new(0.5, 1, 4).unwrap()));
            } else if sched != SchedulerKind::Continuous {
                b = b.looped(|o| o.exit_gate(Replay::new(DepthTrace::with_mean(2.5, 1, 4, 9).unwrap(), 1, 4).unwrap()));
            }
            let mut engine = b.build().unwrap();
            CPU_GRAPH_BODIES.with(|c| c.set(false));
            let ids: Vec<_> = prompts
                .iter()
                .zip(&new_tokens)
                .map(|(p, &n)| engine.add_request(p.clone(), GenerationParams { ignore_eos: true, ..GenerationParams::greedy(n) }).unwrap())
                .collect();
            let mut got: HashMap<crate::RequestId, Vec<u32>> = HashMap::new();
            while engine.has_work() {
                for ev in engine.step().unwrap() {
                    if let Event::Token { id, token, .. } = ev {
                        got.entry(id).or_default().push(token);
                    }
                }
            }
            let metrics = engine.metrics();
            let m = metrics.looped().expect("a looped engine");
            let stats = (m.graph_captures, m.graph_replays);
            let tokens: Vec<Vec<u32>> = ids.iter().map(|id| got.remove(id).unwrap()).collect();
            (tokens, stats, metrics.kernels.arena_steps)
        };
        let run = |model: Box<dyn LoopedModel>, sched: SchedulerKind, layout: KvLayoutKind, width: usize, graphs: bool| {
            let (tokens, stats, _) = run_with(model, sched, layout, width, graphs, Default::default(), false);
            (tokens, stats)
        };
        for (sched, layout, width) in [
            (SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 6),
            (SchedulerKind::Continuous, KvLayoutKind::Shared, 3),
            (SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 5),
            (SchedulerKind::Depth { refill: false }, KvLayoutKind::LastExited, 7),
        ] {
            let (eager, _) = run(Box::new(ouro.clone()), sched, layout, width, false);
            let (bodies, (_, body_runs)) = run(Box::new(ouro.clone()), sched, layout, width, true);
            assert!(body_runs > 0, "{sched:?}: no launch took the graph path");
            assert_eq!(eager, bodies, "ouro {sched:?} {layout:?} W{width}");
        }
        // The decode arena (`KernelPolicy::decode_arena`): the same tokens as the plain body, eager
        // and over the graph bodies, with every core step of a launch within the arena's width
        // on it (CB at W 6 runs prompts of up to 23 tokens in launches wider than that arena, so
        // they keep the plain body).
        let arena = crate::ops::KernelPolicy { decode_arena: true, ..Default::default() };
        for (sched, layout, width, q_exit) in [
            (SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 6, false),
            (SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 5, false),
            (SchedulerKind::Depth { refill: false }, KvLayoutKind::LastExited, 7, false),
            (SchedulerKind::Depth { refill: true }, KvLayoutKind::LastExited, 5, true),
        ] {
            let (plain, _, _) = run_with(Box::new(ouro.clone()), sched, layout, width, false, Default::default(), q_exit);
            for graphs in [false, true] {
                let (tokens, _, arena_steps) = run_with(Box::new(ouro.clone()), sched, layout, width, graphs, arena, q_exit);
                assert!(arena_steps > 0, "ouro {sched:?} graphs {graphs}: no core step ran on the arena");
                assert_eq!(plain, tokens, "ouro arena {sched:?} {layout:?} W{width} graphs {graphs}");
            }
        }
        // Huginn's arena body: the prelude, the core step and the re-entering coda (with its
        // prelude) all on buffers; the same tokens as the plain body.
        for (sched, width) in [(SchedulerKind::Continuous, 3), (SchedulerKind::Depth { refill: false }, 4), (SchedulerKind::Depth { refill: true }, 5)] {
            let layout = KvLayoutKind::Shared;
            let (plain, _, _) = run_with(Box::new(huginn.clone()), sched, layout, width, false, Default::default(), false);
            for graphs in [false, true] {
                let (tokens, _, arena_steps) = run_with(Box::new(huginn.clone()), sched, layout, width, graphs, arena, false);
                assert!(arena_steps > 0, "huginn {sched:?} graphs {graphs}: no core step ran on the arena");
                assert_eq!(plain, tokens, "huginn arena {sched:?} W{width} graphs {graphs}");
            }
        }
        for (sched, width) in [(SchedulerKind::Continuous, 3), (SchedulerKind::Depth { refill: false }, 4), (SchedulerKind::Depth { refill: true }, 5)] {
            let layout = KvLayoutKind::Shared;
            let (eager, _) = run(Box::new(huginn.clone()), sched, layout, width, false);
            let (bodies, (_, body_runs)) = run(Box::new(huginn.clone()), sched, layout, width, true);
            assert!(body_runs > 0, "huginn {sched:?}: no launch took the graph path");
            assert_eq!(eager, bodies, "huginn {sched:?} W{width}");
        }
    }

    #[test]
    fn statics_pad_inputs_and_batches() {
        use crate::ops::{AttnMask, PagedBatch, PagedBatchHost};
        let dev = Device::Cpu;
        let key = GraphKey { stage: Stage::CoreStep, rows: 4, ctx: 256, slots: vec![], reenter: false };
        let st = Statics::new(&key, 10, 16, &dev).unwrap();
        st.write_inputs(&[], &[5, 20], &[], &[1, 0], 9).unwrap();
        assert_eq!(st.positions.to_vec1::<u32>().unwrap(), vec![5, 20, 0, 0]);
        assert_eq!(st.state.to_vec1::<u32>().unwrap(), vec![1, 0, 9, 9]);
        let host = PagedBatchHost { write_positions: Vec::new(), block_tables: vec![vec![3], vec![4, 7]], context_lens: vec![6, 21], cu_q_lens: vec![0, 1, 2] };
        let buf = &st.batches[0].1;
        let b = PagedBatch::fill(&host, 16, AttnMask::Causal, 2, buf, 99, 256).unwrap();
        assert_eq!(b.num_rows(), 4);
        assert_eq!(b.num_tokens(), 4);
        assert_eq!(b.context_lens.to_vec1::<u32>().unwrap(), vec![6, 21, 1, 1]);
        assert_eq!(b.cu_q_lens.to_vec1::<u32>().unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(b.slot_mapping.to_vec1::<u32>().unwrap(), vec![3 * 16 + 5, 7 * 16 + 4, 99 * 16, 99 * 16]);
        let tables = b.block_tables.to_vec2::<u32>().unwrap();
        assert_eq!(tables[1][..3], [4, 7, 99]);
        assert!(tables[3].iter().all(|&x| x == 99));
        assert_eq!(b.write_index().unwrap().dims(), &[4, 2]);
        // The same as a fresh batch over the padded description.
        let fresh = PagedBatch::new(b.host.clone(), 16, AttnMask::Causal, 2, &dev).unwrap();
        assert_eq!(fresh.slot_mapping.to_vec1::<u32>().unwrap(), b.slot_mapping.to_vec1::<u32>().unwrap());
        assert_eq!(fresh.write_index().unwrap().to_vec2::<u32>().unwrap(), b.write_index().unwrap().to_vec2::<u32>().unwrap());
    }
}
