//! Executes scheduler launches on a looped model: builds the device batch, runs the stages,
//! samples, and returns small host values. Loop states of in-flight items live in a device-side
//! state bank (one row per resident request); launches gather and scatter rows by index, so
//! hidden states never cross to the host.

use crate::kv::KvStore;
use crate::models::{LoopedModel, StageInput};
use crate::ops::{AttnMask, PagedBatch, PagedBatchHost};
use crate::sampling::{sample, RowSampling};
use crate::scheduler::{KvCopy, Launch, LaunchResult, LaunchRow, RowOutput, Stage};
use candle_core::{DType, Device, Result, Tensor, D};
use std::collections::BTreeMap;

/// Owns the model, the device KV store and the state bank; runs one launch at a time.
pub struct LoopedRunner {
    model: Box<dyn LoopedModel>,
    kv: KvStore,
    block_size: usize,
    /// `[rows, hidden]` loop state of each in-flight item, in the model dtype.
    bank: Option<Tensor>,
    /// How long the last launch blocked the host on the device.
    last_wait: std::cell::Cell<std::time::Duration>,
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
}

impl LoopedRunner {
    /// `bank_rows` rows of loop state (0 for schedulers that only run full-depth launches).
    pub fn new(model: Box<dyn LoopedModel>, num_blocks: usize, block_size: usize, bank_rows: usize) -> Result<Self> {
        let s = model.spec().clone();
        let dev = model.device().clone();
        let kv = KvStore::new(s.num_kv_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, s.dtype, &dev)?;
        let bank = (bank_rows > 0).then(|| Tensor::zeros((bank_rows, s.hidden_size), s.dtype, &dev)).transpose()?;
        Ok(Self { model, kv, block_size, bank, last_wait: Default::default() })
    }

    pub fn model(&self) -> &dyn LoopedModel {
        self.model.as_ref()
    }

    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// Host time the last [`LoopedRunner::run`] spent blocked on the device.
    pub fn last_wait(&self) -> std::time::Duration {
        self.last_wait.get()
    }

    /// Runs a launch and samples its sampling rows.
    pub fn run(&self, launch: &Launch, sampling: &[RowSampling]) -> Result<LaunchResult> {
        let fwd = self.forward(launch)?;
        // Everything is enqueued: wait here so the blocked time can be measured apart from
        // the host work of building and enqueueing the launch.
        let t = std::time::Instant::now();
        self.device().synchronize()?;
        self.last_wait.set(t.elapsed());
        let n = launch.rows.len();
        let mut tokens = vec![None; n];
        let mut gate_logits = vec![Vec::new(); n];
        let mut latent = vec![None; n];
        if let Some(logits) = &fwd.logits {
            let rows: Vec<RowSampling> = fwd.sample_rows.iter().map(|&r| sampling[r]).collect();
            let ids = sample(logits, &rows)?;
            for (&r, &t) in fwd.sample_rows.iter().zip(&ids) {
                tokens[r] = Some(t);
            }
            if launch.reenter {
                self.reenter(launch, &fwd.sample_rows, &ids)?;
            }
        }
        if let Some(g) = &fwd.gate_logits {
            let row_index: Vec<usize> = if launch.stage == Stage::CoreStep { (0..n).collect() } else { fwd.sample_rows.clone() };
            for (&r, per_step) in row_index.iter().zip(g.t()?.to_vec2::<f32>()?) {
                gate_logits[r] = per_step;
            }
        }
        if let Some(d) = &fwd.latent_diff {
            for (r, v) in d.to_vec1::<f32>()?.into_iter().enumerate() {
                latent[r] = Some(v);
            }
        }
        let rows = launch
            .rows
            .iter()
            .zip(tokens.into_iter().zip(gate_logits).zip(latent))
            .map(|(row, ((token, gate_logits), latent_diff))| RowOutput { request: row.request, token, gate_logits, latent_diff })
            .collect();
        Ok(LaunchResult { rows })
    }

    /// The device side of [`LoopedRunner::run`].
    pub fn forward(&self, launch: &Launch) -> Result<Forward> {
        self.apply_copies(&launch.kv_copies)?;
        match launch.stage {
            Stage::Prefill | Stage::FullDepthDecode => self.full_depth(launch),
            Stage::CoreStep => self.core_step(launch),
            Stage::Coda => self.coda(launch),
        }
    }

    fn bank(&self) -> Result<&Tensor> {
        self.bank.as_ref().ok_or_else(|| candle_core::Error::Msg("launch needs a state bank but the runner has none".into()))
    }

    fn state_index(&self, rows: &[LaunchRow]) -> Result<Tensor> {
        let idx: Vec<u32> = rows.iter().map(|r| r.state).collect();
        Tensor::new(idx.as_slice(), self.device())
    }

    fn write_bank(&self, idx: &Tensor, h: &Tensor) -> Result<()> {
        let bank = self.bank()?;
        let (rows, hidden) = h.dims2()?;
        let index = idx.unsqueeze(1)?.broadcast_as((rows, hidden))?.contiguous()?;
        bank.scatter_set(&index, &h.to_dtype(bank.dtype())?.contiguous()?, 0)
    }

    /// Per-launch inputs and the attention batch of single-token rows, each in its own slot.
    fn token_batch(&self, rows: &[&LaunchRow], slot_of: impl Fn(&LaunchRow) -> usize) -> Result<(StageInput, PagedBatch)> {
        let spec = self.model.spec();
        let positions: Vec<u32> = rows.iter().map(|r| r.start_pos as u32).collect();
        let input = self.model.prepare(&Tensor::new(positions.as_slice(), self.device())?)?;
        let host = PagedBatchHost {
            block_tables: rows.iter().map(|r| r.block_tables[slot_of(r)].clone()).collect(),
            context_lens: rows.iter().map(|r| r.start_pos as u32 + 1).collect(),
            cu_q_lens: (0..=rows.len() as u32).collect(),
        };
        let batch = PagedBatch::new(host, self.block_size, AttnMask::Causal, spec.num_kv_heads * spec.head_dim, self.device())?;
        Ok((input, batch))
    }

    fn core_step(&self, launch: &Launch) -> Result<Forward> {
        let rows: Vec<&LaunchRow> = launch.rows.iter().collect();
        let (input, batch) = self.token_batch(&rows, |r| r.slot)?;
        let idx = self.state_index(&launch.rows)?;
        let h_old = self.bank()?.index_select(&idx, 0)?;
        let out = self.model.core_step(&h_old, &input, &batch, &self.kv)?;
        self.write_bank(&idx, &out.hidden)?;
        let new = out.hidden.to_dtype(DType::F32)?;
        let change = (&new - h_old.to_dtype(DType::F32)?)?.sqr()?.sum(D::Minus1)?.sqrt()?;
        let latent_diff = (change / new.sqr()?.sum(D::Minus1)?.sqrt()?)?;
        Ok(Forward {
            logits: None,
            gate_logits: out.gate_logit.map(|g| g.unsqueeze(0)).transpose()?,
            latent_diff: Some(latent_diff),
            sample_rows: Vec::new(),
        })
    }

    fn coda(&self, launch: &Launch) -> Result<Forward> {
        let h = self.bank()?.index_select(&self.state_index(&launch.rows)?, 0)?;
        let logits = self.model.coda(&h)?;
        Ok(Forward { logits: Some(logits), gate_logits: None, latent_diff: None, sample_rows: (0..launch.rows.len()).collect() })
    }

    /// Eager re-entry: the prelude of each sampled token, written to its row's bank row as the
    /// successor's step-0 state. The successor sits at the position after the row's last token.
    fn reenter(&self, launch: &Launch, sample_rows: &[usize], ids: &[u32]) -> Result<()> {
        let next: Vec<LaunchRow> = sample_rows
            .iter()
            .map(|&r| {
                let row = &launch.rows[r];
                LaunchRow { start_pos: row.start_pos + row.tokens.len(), ..row.clone() }
            })
            .collect();
        let refs: Vec<&LaunchRow> = next.iter().collect();
        let (input, batch) = self.token_batch(&refs, |_| 0)?;
        let h = self.model.prelude(&Tensor::new(ids, self.device())?, &input, &batch, &self.kv)?;
        self.write_bank(&self.state_index(&next)?, &h)
    }

    /// Copies single token rows of K/V in every layer (last-exited fill).
    fn apply_copies(&self, copies: &[KvCopy]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let src: Vec<u32> = copies.iter().map(|c| c.src).collect();
        let dst: Vec<u32> = copies.iter().map(|c| c.dst).collect();
        let src = Tensor::new(src.as_slice(), self.device())?;
        let dst = Tensor::new(dst.as_slice(), self.device())?;
        let mut index = None;
        for layer in 0..self.kv.num_layers() {
            for cache in [self.kv.k(layer), self.kv.v(layer)] {
                let (nb, bs, kvh, hd) = cache.dims4()?;
                let flat = cache.reshape((nb * bs, kvh * hd))?;
                let index = match &index {
                    Some(i) => i,
                    None => index.insert(dst.unsqueeze(1)?.broadcast_as((copies.len(), kvh * hd))?.contiguous()?),
                };
                flat.scatter_set(index, &flat.index_select(&src, 0)?, 0)?;
            }
        }
        Ok(())
    }

    /// Full-depth launch (prefill or CB decode): prelude, every step in `launch.step_slots`,
    /// coda of each sampling row's last token.
    fn full_depth(&self, launch: &Launch) -> Result<Forward> {
        let dev = self.model.device();
        let spec = self.model.spec();
        let mut ids = Vec::with_capacity(launch.num_tokens());
        let mut positions = Vec::with_capacity(launch.num_tokens());
        let mut cu = vec![0u32];
        for row in &launch.rows {
            ids.extend_from_slice(&row.tokens);
            positions.extend((row.start_pos..row.start_pos + row.tokens.len()).map(|p| p as u32));
            cu.push(ids.len() as u32);
        }
        let ids_t = Tensor::new(ids.as_slice(), dev)?;
        let input = self.model.prepare(&Tensor::new(positions.as_slice(), dev)?)?;

        // One batch description per distinct slot; steps sharing a slot share it.
        let mut batches: BTreeMap<usize, PagedBatch> = BTreeMap::new();
        for &slot in &launch.step_slots {
            if batches.contains_key(&slot) {
                continue;
            }
            let host = PagedBatchHost {
                block_tables: launch.rows.iter().map(|r| r.block_tables[slot].clone()).collect(),
                context_lens: launch.rows.iter().map(|r| (r.start_pos + r.tokens.len()) as u32).collect(),
                cu_q_lens: cu.clone(),
            };
            let kv_width = spec.num_kv_heads * spec.head_dim;
            batches.insert(slot, PagedBatch::new(host, self.block_size, AttnMask::Causal, kv_width, dev)?);
        }
        let first = &batches[&launch.step_slots[0]];
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
        if sample_rows.is_empty() {
            return Ok(Forward { logits: None, gate_logits: None, latent_diff: None, sample_rows });
        }
        let logits = self.model.coda(&h.index_select(&last_idx, 0)?)?;
        let gate_logits = (!gates.is_empty()).then(|| Tensor::stack(&gates, 0)).transpose()?;
        Ok(Forward { logits: Some(logits), gate_logits, latent_diff: None, sample_rows })
    }
}
