//! Executes scheduler launches on a looped model: builds the device batch, runs the stages,
//! samples, and returns small host values. Loop states of in-flight items live in a device-side
//! state bank (one row per resident request); launches gather and scatter rows by index, so
//! hidden states never cross to the host.

use crate::engine::DeviceSpan;
use crate::kv::KvStore;
use crate::looped::models::{LoopedModel, StageInput};
use crate::looped::{KvCopy, LoopedLaunch, LoopedResult, LoopedRow, LoopedRowOutput, Stage};
use crate::ops::{AttnMask, PagedBatch, PagedBatchHost};
use crate::sampling::{sample_or_force, RowSampling};
use candle_core::{DType, Device, Result, Tensor};
use graphs::GraphCache;
use readback::{Readback, ReadbackPool};
use std::collections::BTreeMap;

mod graph_path;
pub(crate) mod graphs;
mod readback;

/// Owns the model, the device KV store and the state bank; runs one launch at a time.
pub struct LoopedRunner {
    model: Box<dyn LoopedModel>,
    kv: KvStore,
    block_size: usize,
    /// `[rows, hidden]` loop state of each in-flight item, in the model dtype.
    bank: Option<Tensor>,
    /// How long the last launch blocked the host on the device.
    last_wait: std::cell::Cell<std::time::Duration>,
    /// Captured decode graphs (CUDA with graphs on); see `engine::graphs`.
    graphs: Option<std::cell::RefCell<GraphCache>>,
    /// KV block and state-bank row that padding rows of replayed graphs use (owned by no
    /// request: the scheduler's pool and bank end before them).
    scratch_block: u32,
    scratch_row: u32,
    /// Capture graphs after the warm-up (`LoopedOptions::graph_capture`; off: run the graph
    /// bodies eagerly instead, to tell padding effects from capture effects).
    capture: bool,
    /// Record a stream event before and after each launch (CUDA), so that its device-side span
    /// is known once its results are collected.
    device_timing: bool,
    /// Device-side span of the last collected launch (`None` without timing or off CUDA).
    last_device: std::cell::Cell<Option<DeviceSpan>>,
    /// Core steps compute the relative latent change (the exit gate reads it).
    compute_latent: bool,
    /// Pinned host buffers for sampled ids and for gate logits / latent changes.
    ids_readback: ReadbackPool<u32>,
    f32_readback: ReadbackPool<f32>,
    /// Check every launch before running it (launches from a custom scheduler).
    check_launches: bool,
    /// With a decode arena: the graphs' gather of state-bank rows (`[arena rows, state_width]`)
    /// and a re-entering coda's greedy ids (`[arena rows]` u32).
    gathered: Option<Tensor>,
    greedy_ids: Option<Tensor>,
}

/// Stream events around one launch: its device-side span is `start → end`, its forward's
/// `start → forward`.
#[cfg(feature = "cuda")]
struct Marks {
    start: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    forward: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    end: candle_core::cuda_backend::cudarc::driver::CudaEvent,
}
#[cfg(not(feature = "cuda"))]
struct Marks;

/// An issued launch whose small results are still on their way to the host.
pub struct Pending {
    stage: Stage,
    requests: Vec<crate::request::RequestId>,
    sample_rows: Vec<usize>,
    tokens: PendingTokens,
    /// Gate logits, row-major per row, and the number of steps per row.
    gates: Option<(Readback<f32>, usize)>,
    latent: Option<Readback<f32>>,
    marks: Option<Marks>,
}

enum PendingTokens {
    None,
    /// Sampled or forced on the host already, with forced tokens' log-probabilities.
    Host(Vec<u32>, Vec<Option<crate::TokenLogprob>>),
    /// Greedy ids still being copied from the device.
    Device(Readback<u32>),
}

/// Device outputs of a launch, before sampling.
#[derive(Debug)]
pub struct Forward {
    /// `[sampled rows, vocab]` f32.
    pub logits: Option<Tensor>,
    /// `[steps, sampled rows]` f32 (full-depth launches) or `[1, rows]` (core steps).
    pub gate_logits: Option<Tensor>,
    /// `[rows]` f32 relative latent change (core steps).
    pub latent_diff: Option<Tensor>,
    /// Launch row index of each sampled row.
    pub sample_rows: Vec<usize>,
    /// `[sampled rows]` u32 greedy ids when the forward already took the argmax and ran the
    /// eager re-entry on the device (a re-entering coda graph).
    pub greedy_ids: Option<Tensor>,
}

impl LoopedRunner {
    #[cfg(any(test, feature = "testing"))]
    /// `bank_rows` rows of loop state (0 for schedulers that only run full-depth launches).
    /// Runs every launch eagerly (no CUDA graphs).
    pub fn new(model: Box<dyn LoopedModel>, num_blocks: usize, block_size: usize, bank_rows: usize) -> Result<Self> {
        Self::with_cuda_graphs(model, num_blocks, block_size, bank_rows, false)
    }

    /// Like [`LoopedRunner::new`]; with `cuda_graphs` on a CUDA device, decode launches (core
    /// steps, full-depth decode, coda) are captured once per shape and replayed. The KV store
    /// and the bank then get one extra block / row past `num_blocks` / `bank_rows` for padding.
    pub fn with_cuda_graphs(model: Box<dyn LoopedModel>, num_blocks: usize, block_size: usize, bank_rows: usize, cuda_graphs: bool) -> Result<Self> {
        let s = model.spec().clone();
        let dev = model.device().clone();
        let cpu_bodies = graphs::CPU_GRAPH_BODIES.with(|c| c.get());
        let graphs = cuda_graphs && (cfg!(feature = "cuda") && dev.is_cuda() || cpu_bodies);
        let extra = usize::from(graphs);
        let kv = KvStore::new(s.num_kv_layers, num_blocks + extra, block_size, s.num_kv_heads, s.head_dim, s.dtype, &dev)?;
        let bank = (bank_rows > 0).then(|| Tensor::zeros((bank_rows + extra, s.state_width), s.dtype, &dev)).transpose()?;
        if graphs {
            graphs::prepare_device(&dev);
        }
        // cuBLAS's workspace for the captures, made with the pool and the bank (the engine's
        // budget holds it) rather than at the first capture, where a full device would fail it.
        let workspace = (graphs && dev.is_cuda()).then(|| graphs::GemmWorkspace::new(&dev).map(std::sync::Arc::new)).transpose()?;
        Ok(Self {
            model,
            kv,
            block_size,
            bank,
            last_wait: Default::default(),
            graphs: graphs.then(|| std::cell::RefCell::new(GraphCache { workspace, ..Default::default() })),
            scratch_block: num_blocks as u32,
            scratch_row: bank_rows as u32,
            capture: true,
            device_timing: false,
            last_device: Default::default(),
            compute_latent: true,
            ids_readback: ReadbackPool::default(),
            f32_readback: ReadbackPool::default(),
            check_launches: false,
            gathered: None,
            greedy_ids: None,
        })
    }

    /// Measures each launch's device-side span with a pair of stream events (CUDA only): from
    /// the moment the device reaches the launch's first kernel to the end of its last, idle gaps
    /// inside the launch included. Costs two event records per launch and no synchronisation
    /// beyond collecting the results.
    pub fn with_device_timing(mut self, on: bool) -> Self {
        self.device_timing = on;
        self
    }

    /// Checks each launch before running it: a block, state row, slot or token out of range is
    /// an error for that launch instead of an out-of-bounds access. For schedulers the
    /// conformance suites do not cover (custom ones).
    pub fn with_launch_checks(mut self, on: bool) -> Self {
        self.check_launches = on;
        self
    }

    /// Whether graphs are captured (default) or their bodies run eagerly
    /// (`LoopedOptions::graph_capture`).
    pub fn with_graph_capture(mut self, on: bool) -> Self {
        self.capture = on;
        self
    }

    /// Whether core steps compute the relative latent change ‖s_r − s_{r−1}‖ / ‖s_r‖ (default on;
    /// off when the exit gate does not read it).
    pub fn with_latent_diff(mut self, on: bool) -> Self {
        self.compute_latent = on;
        self
    }

    /// Has the model preallocate its decode body's activations for launches of up to `rows`
    /// rows (`KernelPolicy::decode_arena`), where it has such a body; returns whether it did.
    pub fn install_decode_arena(&mut self, rows: usize) -> crate::Result<bool> {
        let installed = self.model.install_decode_arena(rows)?;
        let s = self.model.spec();
        let (dev, with_bank) = (self.model.device(), installed && self.bank.is_some());
        self.gathered = with_bank.then(|| Tensor::zeros((rows, s.state_width), s.dtype, dev)).transpose()?;
        self.greedy_ids = with_bank.then(|| Tensor::zeros(rows, DType::U32, dev)).transpose()?;
        Ok(installed)
    }

    /// A re-entering coda's greedy ids of `logits`, the flagged ones written into `flagged`
    /// (`[rows]` u32): the ids into the arena's buffer where there is one that holds them.
    fn greedy_ids_to(&self, logits: &Tensor, flagged: &Tensor) -> Result<Tensor> {
        let (rows, vocab) = (logits.dim(0)?, self.model.spec().vocab_size);
        match &self.greedy_ids {
            Some(buf) if rows <= buf.dim(0)? => {
                let ids = buf.narrow(0, 0, rows)?;
                crate::ops::into::greedy_ids_flagged_into(logits, vocab, &ids, flagged)?;
                Ok(ids)
            }
            _ => {
                let (ids, f) = crate::ops::greedy_ids_flagged(logits, vocab)?;
                flagged.slice_set(&f, 0, 0)?;
                Ok(ids)
            }
        }
    }

    /// The bank rows `idx` (`[rows]` u32 on the device): into the arena's buffer where there is
    /// one that holds them, else gathered into a new tensor.
    fn gather_states(&self, idx: &Tensor) -> Result<Tensor> {
        let rows = idx.dim(0)?;
        match &self.gathered {
            Some(buf) if rows <= buf.dim(0)? => {
                let out = buf.narrow(0, 0, rows)?;
                crate::ops::into::gather_rows_into(self.bank()?, idx, &out)?;
                Ok(out)
            }
            _ => self.bank()?.index_select(idx, 0),
        }
    }

    /// Device-side span of the last collected launch (`None` without device timing, or off CUDA).
    pub fn last_device_time(&self) -> Option<DeviceSpan> {
        self.last_device.get()
    }

    /// A timing event recorded on the device's stream now (`None` when timing is off).
    #[cfg(feature = "cuda")]
    fn mark(&self) -> Result<Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        use candle_core::cuda_backend::WrapErr;
        match self.device() {
            Device::Cuda(d) if self.device_timing => Ok(Some(d.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?)),
            _ => Ok(None),
        }
    }

    /// Drops every captured graph (each shape is warmed up and captured again when next used):
    /// after a tensor-parallel group was rebuilt, graphs hold collectives on its old
    /// communicators.
    pub(crate) fn forget_graphs(&self) {
        if let Some(g) = &self.graphs {
            g.borrow_mut().entries.clear();
        }
    }

    /// (graphs captured, launches replayed) so far.
    pub fn graph_stats(&self) -> crate::looped::metrics::GraphStats {
        self.graphs.as_ref().map_or_else(Default::default, |g| {
            let g = g.borrow();
            crate::looped::metrics::GraphStats { captures: g.captures, replays: g.replays, nodes: g.nodes }
        })
    }

    pub fn model(&self) -> &dyn LoopedModel {
        self.model.as_ref()
    }

    pub fn device(&self) -> &Device {
        self.model.device()
    }

    #[cfg(any(test, feature = "testing"))]
    /// Host time the last [`LoopedRunner::run`] spent blocked on the device.
    pub fn last_wait(&self) -> std::time::Duration {
        self.last_wait.get()
    }

    #[cfg(any(test, feature = "testing"))]
    /// Runs a launch and samples its sampling rows (issue + collect).
    pub fn run(&self, launch: &LoopedLaunch, sampling: &[RowSampling]) -> Result<LoopedResult> {
        let pending = self.launch(launch, sampling)?;
        self.collect(pending)
    }

    /// Issues a launch: queues its kernels, the greedy argmax and eager re-entry on the device,
    /// and asynchronous copies of its small results, without waiting for any of them (on CUDA,
    /// with greedy, unforced rows). Sampling with randomness or forced tokens reads the logits
    /// back at once. [`LoopedRunner::collect`] waits for the results.
    pub fn launch(&self, launch: &LoopedLaunch, sampling: &[RowSampling]) -> Result<Pending> {
        if self.check_launches {
            let bounds = crate::engine::launch_check::Bounds {
                num_blocks: self.scratch_block as usize,
                block_size: self.block_size,
                bank_rows: if self.bank.is_some() { self.scratch_row as usize } else { 0 },
                vocab_size: self.model.spec().vocab_size,
            };
            crate::engine::launch_check::check_looped(launch, &bounds).map_err(|e| candle_core::Error::Msg(format!("invalid launch: {e}")))?;
        }
        #[cfg(feature = "cuda")]
        let start = self.mark()?;
        let greedy = |r: &RowSampling| r.greedy && !r.wants_logprob();
        let all_greedy = launch.rows.iter().zip(sampling).all(|(row, r)| !row.sample || greedy(r));
        let fwd = self.forward_with(launch, all_greedy)?;
        #[cfg(feature = "cuda")]
        let forward_end = self.mark()?;
        let mut tokens = PendingTokens::None;
        if let Some(ids) = &fwd.greedy_ids {
            tokens = PendingTokens::Device(Readback::start(ids, &self.ids_readback)?);
        } else if let Some(logits) = &fwd.logits {
            let rows: Vec<RowSampling> = fwd.sample_rows.iter().map(|&r| sampling[r]).collect();
            let vocab = self.model.spec().vocab_size;
            if logits.device().is_cuda() && all_greedy {
                let (ids, flagged) = crate::ops::greedy_ids_flagged(logits, vocab)?;
                if launch.reenter {
                    self.reenter(launch, &fwd.sample_rows, &ids)?;
                }
                tokens = PendingTokens::Device(Readback::start(&flagged, &self.ids_readback)?);
            } else {
                let (ids, logprobs) = sample_or_force(logits, &rows)?;
                if launch.reenter {
                    self.reenter(launch, &fwd.sample_rows, &Tensor::new(ids.as_slice(), self.device())?)?;
                }
                let bad: Vec<u8> = crate::ops::non_finite_rows(logits)?.to_vec1()?;
                let ids = ids.into_iter().zip(bad).map(|(t, b)| if b == 0 { t } else { t.min(vocab as u32 - 1) + vocab as u32 }).collect();
                tokens = PendingTokens::Host(ids, logprobs);
            }
        }
        let gates = match &fwd.gate_logits {
            Some(g) => Some((Readback::start(&g.t()?, &self.f32_readback)?, g.dim(0)?)),
            None => None,
        };
        let latent = fwd.latent_diff.as_ref().map(|d| Readback::start(d, &self.f32_readback)).transpose()?;
        #[cfg(feature = "cuda")]
        let marks = match (start, forward_end, self.mark()?) {
            (Some(start), Some(forward), Some(end)) => Some(Marks { start, forward, end }),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let marks: Option<Marks> = None;
        Ok(Pending {
            stage: launch.stage,
            requests: launch.rows.iter().map(|r| r.request).collect(),
            sample_rows: fwd.sample_rows,
            tokens,
            gates,
            latent,
            marks,
        })
    }

    /// Waits for an issued launch's results (only for their copies) and returns them.
    pub fn collect(&self, p: Pending) -> Result<LoopedResult> {
        let started = std::time::Instant::now();
        let n = p.requests.len();
        let mut tokens = vec![None; n];
        let mut logprobs = vec![None; n];
        match p.tokens {
            PendingTokens::None => {}
            PendingTokens::Host(ids, lps) => {
                for ((&r, t), lp) in p.sample_rows.iter().zip(ids).zip(lps) {
                    tokens[r] = Some(t);
                    logprobs[r] = lp;
                }
            }
            PendingTokens::Device(rb) => {
                for (&r, t) in p.sample_rows.iter().zip(rb.finish(&self.ids_readback)?) {
                    tokens[r] = Some(t);
                }
            }
        }
        let mut gate_logits = vec![Vec::new(); n];
        if let Some((rb, steps)) = p.gates {
            let row_index: Vec<usize> = if p.stage == Stage::CoreStep { (0..n).collect() } else { p.sample_rows.clone() };
            for (&r, per_step) in row_index.iter().zip(rb.finish(&self.f32_readback)?.chunks(steps.max(1))) {
                gate_logits[r] = per_step.to_vec();
            }
        }
        let mut latent = vec![None; n];
        if let Some(rb) = p.latent {
            for (r, v) in rb.finish(&self.f32_readback)?.into_iter().enumerate() {
                latent[r] = Some(v);
            }
        }
        self.last_wait.set(started.elapsed());
        self.last_device.set(match p.marks {
            #[cfg(feature = "cuda")]
            Some(Marks { start, forward, end }) => {
                use candle_core::cuda_backend::WrapErr;
                let secs = |to: &candle_core::cuda_backend::cudarc::driver::CudaEvent| -> Result<std::time::Duration> {
                    Ok(std::time::Duration::from_secs_f64(f64::from(start.elapsed_ms(to).w()?) / 1e3))
                };
                Some(DeviceSpan { total: secs(&end)?, forward: secs(&forward)? })
            }
            #[cfg(not(feature = "cuda"))]
            Some(Marks) => None,
            None => None,
        });
        // The device flags a row whose logits were not finite by an id ≥ vocab; here that
        // becomes the result's typed outcome and the row carries no token.
        let vocab = self.model.spec().vocab_size;
        let mut non_finite = Vec::new();
        for (token, request) in tokens.iter_mut().zip(&p.requests) {
            if token.is_some_and(|t| crate::ops::is_non_finite_flag(t, vocab)) {
                *token = None;
                non_finite.push(*request);
            }
        }
        let rows = p
            .requests
            .into_iter()
            .zip(tokens.into_iter().zip(gate_logits).zip(latent).zip(logprobs))
            .map(|(request, (((token, gate_logits), latent_diff), logprob))| LoopedRowOutput { request, token, gate_logits, latent_diff, logprob })
            .collect();
        Ok(LoopedResult { rows, non_finite })
    }

    #[cfg(any(test, feature = "testing"))]
    /// The device side of [`LoopedRunner::run`]. With CUDA graphs the returned tensors may be
    /// views of static buffers that the next launch of the same shape overwrites.
    pub fn forward(&self, launch: &LoopedLaunch) -> Result<Forward> {
        self.forward_with(launch, false)
    }

    /// [`LoopedRunner::forward`]; `all_greedy`: every sampled row decodes greedily, unforced, so
    /// a re-entering coda may take the argmax and run the re-entry inside its graph.
    fn forward_with(&self, launch: &LoopedLaunch, all_greedy: bool) -> Result<Forward> {
        self.apply_copies(&launch.kv_copies)?;
        if let Some(fwd) = self.graph_forward(launch, all_greedy)? {
            return Ok(fwd);
        }
        match launch.stage {
            Stage::Prefill | Stage::FullDepthDecode => self.full_depth(launch),
            Stage::CoreStep => self.core_step(launch),
            Stage::Coda => self.coda(launch),
        }
    }

    fn bank(&self) -> Result<&Tensor> {
        self.bank.as_ref().ok_or_else(|| candle_core::Error::Msg("launch needs a state bank but the runner has none".into()))
    }

    fn state_index<'a>(&self, rows: impl IntoIterator<Item = &'a LoopedRow>) -> Result<Tensor> {
        let idx: Vec<u32> = rows.into_iter().map(|r| r.state).collect();
        Tensor::new(idx.as_slice(), self.device())
    }

    fn write_bank(&self, idx: &Tensor, h: &Tensor) -> Result<()> {
        crate::ops::scatter_rows(self.bank()?, h, idx)
    }

    /// Per-launch inputs and the attention batch of single-token rows: row `r` sits at position
    /// `pos_of(r)` and attends through its table `table_of(r)`.
    fn token_batch(
        &self,
        rows: &[&LoopedRow],
        table_of: impl Fn(&LoopedRow) -> usize,
        pos_of: impl Fn(&LoopedRow) -> usize,
    ) -> Result<(StageInput, PagedBatch)> {
        let spec = self.model.spec();
        let positions: Vec<u32> = rows.iter().map(|r| pos_of(r) as u32).collect();
        let input = self.model.prepare(&Tensor::new(positions.as_slice(), self.device())?)?;
        let host = single_token_host(rows.iter().copied(), table_of, pos_of);
        let batch = PagedBatch::new(host, self.block_size, AttnMask::Causal, spec.num_kv_heads * spec.head_dim, self.device())?;
        Ok((input, batch))
    }

    fn core_step(&self, launch: &LoopedLaunch) -> Result<Forward> {
        let rows: Vec<&LoopedRow> = launch.rows.iter().collect();
        let (input, batch) = self.token_batch(&rows, |r| r.slot, |r| r.start_pos)?;
        let idx = self.state_index(&launch.rows)?;
        let h_old = self.bank()?.index_select(&idx, 0)?;
        let out = self.model.core_step(&h_old, &input, &batch, &self.kv)?;
        self.write_bank(&idx, &out.hidden)?;
        let latent_diff = self.compute_latent.then(|| self.latent_diff(&h_old, &out.hidden)).transpose()?;
        Ok(Forward { logits: None, gate_logits: out.gate_logit.map(|g| g.unsqueeze(0)).transpose()?, latent_diff, sample_rows: Vec::new(), greedy_ids: None })
    }

    /// ‖s_r − s_{r−1}‖ / ‖s_r‖ per row, over the state proper (the first `hidden_size` columns).
    fn latent_diff(&self, old: &Tensor, new: &Tensor) -> Result<Tensor> {
        crate::ops::fused::latent_change(old, new, self.model.spec().hidden_size)
    }

    fn coda(&self, launch: &LoopedLaunch) -> Result<Forward> {
        let h = self.bank()?.index_select(&self.state_index(&launch.rows)?, 0)?;
        let rows: Vec<&LoopedRow> = launch.rows.iter().collect();
        let (input, batch) = self.token_batch(&rows, |_| 0, |r| r.start_pos)?;
        let logits = self.model.head(&self.model.coda(&h, &input, &batch, &self.kv)?)?;
        Ok(Forward { logits: Some(logits), gate_logits: None, latent_diff: None, sample_rows: (0..launch.rows.len()).collect(), greedy_ids: None })
    }

    /// Eager re-entry: the prelude of each sampled token, written to its row's bank row as the
    /// successor's step-0 state. The successor sits at the position after the row's last token.
    fn reenter(&self, launch: &LoopedLaunch, sample_rows: &[usize], ids: &Tensor) -> Result<()> {
        let rows: Vec<&LoopedRow> = sample_rows.iter().map(|&r| &launch.rows[r]).collect();
        let (input, batch) = self.token_batch(&rows, |_| 0, successor_pos)?;
        let h = self.model.prelude(ids, &input, &batch, &self.kv)?;
        self.write_bank(&self.state_index(rows.iter().copied())?, &h)
    }

    /// Copies single token rows of K/V in every layer (last-exited fill): one launch on CUDA.
    fn apply_copies(&self, copies: &[KvCopy]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let src: Vec<u32> = copies.iter().map(|c| c.src).collect();
        let dst: Vec<u32> = copies.iter().map(|c| c.dst).collect();
        let caches: Vec<&Tensor> = (0..self.kv.num_layers()).flat_map(|l| [self.kv.k(l), self.kv.v(l)]).collect();
        let Some(first) = caches.first() else {
            return Ok(());
        };
        let (_, _, kvh, hd) = first.dims4()?;
        crate::ops::copy_rows(&caches, kvh * hd, &src, &dst)
    }

    /// Full-depth launch (prefill or CB decode): prelude, every step in `launch.step_slots`,
    /// coda of each sampling row's last token.
    fn full_depth(&self, launch: &LoopedLaunch) -> Result<Forward> {
        let dev = self.model.device();
        let spec = self.model.spec();
        let mut ids = Vec::with_capacity(launch.num_tokens());
        let mut positions = Vec::with_capacity(launch.num_tokens());
        for row in &launch.rows {
            ids.extend_from_slice(&row.tokens);
            positions.extend((row.start_pos..row.context_len()).map(|p| p as u32));
        }
        let ids_t = Tensor::new(ids.as_slice(), dev)?;
        let input = self.model.prepare(&Tensor::new(positions.as_slice(), dev)?)?;

        // One batch description per distinct slot; steps sharing a slot share it.
        let mut batches: BTreeMap<usize, PagedBatch> = BTreeMap::new();
        for &slot in &launch.step_slots {
            if batches.contains_key(&slot) {
                continue;
            }
            let mut host = PagedBatchHost::new();
            for r in &launch.rows {
                host.push_row(&r.block_tables[slot], r.context_len(), r.tokens.len(), None);
            }
            let kv_width = spec.num_kv_heads * spec.head_dim;
            batches.insert(slot, PagedBatch::new(host, self.block_size, AttnMask::Causal, kv_width, dev)?);
        }
        let first = &batches[&launch.step_slots[0]];
        let cu = &first.host.cu_q_lens;
        let mut h = self.model.prelude(&ids_t, &input, first, &self.kv)?;
        let sample_rows: Vec<usize> = (0..launch.rows.len()).filter(|&r| launch.rows[r].sample).collect();
        let last_idx: Vec<u32> = sample_rows.iter().map(|&r| cu[r + 1] - 1).collect();
        let last_idx = Tensor::new(last_idx.as_slice(), dev)?;
        let mut gates = Vec::with_capacity(launch.step_slots.len());
        for slot in &launch.step_slots {
            let out = self.model.core_step(&h, &input, &batches[slot], &self.kv)?;
            h = out.hidden;
            if let (Some(g), false) = (out.gate_logit, sample_rows.is_empty()) {
                gates.push(g.index_select(&last_idx, 0)?);
            }
        }
        // The coda runs over every token: models with coda blocks write their KV here.
        let y = self.model.coda(&h, &input, first, &self.kv)?;
        if sample_rows.is_empty() {
            return Ok(Forward { logits: None, gate_logits: None, latent_diff: None, sample_rows, greedy_ids: None });
        }
        let logits = self.model.head(&y.index_select(&last_idx, 0)?)?;
        let gate_logits = (!gates.is_empty()).then(|| Tensor::stack(&gates, 0)).transpose()?;
        Ok(Forward { logits: Some(logits), gate_logits, latent_diff: None, sample_rows, greedy_ids: None })
    }
}

/// Where a row's successor sits when it re-enters: after the row's last token.
fn successor_pos(row: &LoopedRow) -> usize {
    row.context_len()
}

/// Paged addressing of single-token rows: row `r` attends through its table `table_of(r)` to
/// every position up to `pos_of(r)`.
fn single_token_host<'a>(
    rows: impl Iterator<Item = &'a LoopedRow>,
    table_of: impl Fn(&LoopedRow) -> usize,
    pos_of: impl Fn(&LoopedRow) -> usize,
) -> PagedBatchHost {
    let mut host = PagedBatchHost::new();
    for r in rows {
        host.push_row(&r.block_tables[table_of(r)], pos_of(r) + 1, 1, None);
    }
    host
}
