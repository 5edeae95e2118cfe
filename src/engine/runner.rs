//! Executes scheduler launches on a looped model: builds the device batch, runs the stages,
//! samples, and returns small host values.

use crate::kv::KvStore;
use crate::models::LoopedModel;
use crate::ops::{AttnMask, PagedBatch, PagedBatchHost};
use crate::sampling::{sample, RowSampling};
use crate::scheduler::{Launch, LaunchResult, RowOutput};
use candle_core::{Device, Result, Tensor};
use std::collections::BTreeMap;

/// Owns the model and the device KV store; runs one launch at a time.
pub struct LoopedRunner {
    model: Box<dyn LoopedModel>,
    kv: KvStore,
    block_size: usize,
}

impl LoopedRunner {
    pub fn new(model: Box<dyn LoopedModel>, num_blocks: usize, block_size: usize) -> Result<Self> {
        let s = model.spec().clone();
        let kv = KvStore::new(s.num_kv_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, s.dtype, model.device())?;
        Ok(Self { model, kv, block_size })
    }

    pub fn model(&self) -> &dyn LoopedModel {
        self.model.as_ref()
    }

    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// Runs a full-depth launch (prefill or CB decode): prelude, every step in
    /// `launch.step_slots`, coda of each sampling row's last token, then samples.
    pub fn run(&self, launch: &Launch, sampling: &[RowSampling]) -> Result<LaunchResult> {
        let fwd = self.forward(launch)?;
        let mut tokens = vec![None; launch.rows.len()];
        let mut gate_logits = vec![Vec::new(); launch.rows.len()];
        if let Some(logits) = &fwd.logits {
            let rows: Vec<RowSampling> = fwd.sample_rows.iter().map(|&r| sampling[r]).collect();
            for (&r, t) in fwd.sample_rows.iter().zip(sample(logits, &rows)?) {
                tokens[r] = Some(t);
            }
            if let Some(g) = &fwd.gate_logits {
                for (&r, per_step) in fwd.sample_rows.iter().zip(g.t()?.to_vec2::<f32>()?) {
                    gate_logits[r] = per_step;
                }
            }
        }
        let rows = launch
            .rows
            .iter()
            .zip(tokens.into_iter().zip(gate_logits))
            .map(|(row, (token, gate_logits))| RowOutput { request: row.request, token, gate_logits })
            .collect();
        Ok(LaunchResult { rows })
    }

    /// The device side of [`LoopedRunner::run`]: logits `[sampled rows, vocab]` (f32) and the
    /// gate logits `[steps, sampled rows]` of each sampling row's last token.
    pub fn forward(&self, launch: &Launch) -> Result<Forward> {
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
            return Ok(Forward { logits: None, gate_logits: None, sample_rows });
        }
        let logits = self.model.coda(&h.index_select(&last_idx, 0)?)?;
        let gate_logits = (!gates.is_empty()).then(|| Tensor::stack(&gates, 0)).transpose()?;
        Ok(Forward { logits: Some(logits), gate_logits, sample_rows })
    }
}

/// Device outputs of one full-depth launch, before sampling.
#[derive(Debug)]
pub struct Forward {
    /// `[sampled rows, vocab]` f32.
    pub logits: Option<Tensor>,
    /// `[steps, sampled rows]` f32.
    pub gate_logits: Option<Tensor>,
    /// Launch row index of each sampled row.
    pub sample_rows: Vec<usize>,
}
