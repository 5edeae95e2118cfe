//! The CUDA-graph path of [`LoopedRunner`]: which launches have a graph ([`GraphKey`]), writing
//! a launch into its key's static buffers, and what a graph runs. The first use of a key runs
//! the body eagerly (the warm-up), the second captures it, later uses replay it.

use super::graphs::{ctx_bucket, row_bucket, Entry, Graph, GraphKey, Phase, Statics};
use super::{single_token_host, successor_pos, Forward, LoopedRunner};
use crate::looped::{LoopedLaunch, LoopedRow, Stage};
use crate::ops::{AttnMask, PagedBatch, PagedBatchHost};
use candle_core::Result;

impl LoopedRunner {
    /// The graph key of a launch, or `None` when it runs eagerly.
    fn graph_key(&self, launch: &LoopedLaunch, all_greedy: bool) -> Option<GraphKey> {
        let n = launch.rows.len();
        if n == 0 {
            return None;
        }
        let rows = row_bucket(n)?;
        let max_ctx = launch.rows.iter().map(|r| r.start_pos + 1).max()?;
        match launch.stage {
            Stage::CoreStep => {
                self.bank.as_ref()?;
                launch.rows.iter().all(|r| r.slot < r.block_tables.len()).then_some(())?;
                Some(GraphKey { stage: Stage::CoreStep, rows, ctx: ctx_bucket(max_ctx), slots: Vec::new(), reenter: false })
            }
            Stage::FullDepthDecode => {
                let ok = !launch.step_slots.is_empty()
                    && !launch.reenter
                    && launch.rows.iter().all(|r| r.tokens.len() == 1 && r.sample && launch.step_slots.iter().all(|&s| s < r.block_tables.len()));
                ok.then(|| GraphKey { stage: Stage::FullDepthDecode, rows, ctx: ctx_bucket(max_ctx), slots: launch.step_slots.clone(), reenter: false })
            }
            Stage::Coda => {
                self.bank.as_ref()?;
                // The coda attends through slot 0 (prelude and coda layers use it); a heavy coda
                // (Huginn's blocks) writes and reads its KV there like a full-depth decode does.
                // Re-entered successors sit one position later, in the same bucket or the next.
                let reenter = launch.reenter && all_greedy;
                Some(GraphKey { stage: Stage::Coda, rows, ctx: ctx_bucket(max_ctx + usize::from(reenter)), slots: vec![0], reenter })
            }
            _ => None,
        }
    }

    /// Runs `launch` through its graph (warm-up, capture or replay). `None`: run it eagerly.
    pub(super) fn graph_forward(&self, launch: &LoopedLaunch, all_greedy: bool) -> Result<Option<Forward>> {
        let Some(cell) = &self.graphs else {
            return Ok(None);
        };
        let Some(key) = self.graph_key(launch, all_greedy) else {
            return Ok(None);
        };
        let mut guard = cell.borrow_mut();
        let cache = &mut *guard;
        if !cache.entries.contains_key(&key) {
            let statics = Statics::new(&key, self.model.spec().vocab_size, self.block_size, self.device())?;
            cache.entries.insert(key.clone(), Entry { statics, phase: Phase::New });
        }
        let entry = cache.entries.get_mut(&key).expect("inserted above");
        if matches!(entry.phase, Phase::Failed) {
            return Ok(None);
        }
        let padded = self.write_graph_inputs(&key, &entry.statics, launch)?;
        let dev = self.device();
        let mut failure = None;
        match &entry.phase {
            Phase::New => {
                let r = Graph::warm_up(dev, || self.graph_body(&key, &entry.statics, &padded));
                match r {
                    Ok(has_gate) => {
                        entry.statics.has_gate = has_gate;
                        // Off CUDA (tests), or with graph capture off, the body always
                        // runs eagerly over the padded buffers: never capture.
                        if dev.is_cuda() && self.capture {
                            entry.phase = Phase::Warm;
                        }
                        cache.replays += usize::from(!(dev.is_cuda() && self.capture));
                    }
                    Err(e) => failure = Some(format!("warm-up: {e}")),
                }
            }
            Phase::Warm => {
                let statics = &entry.statics;
                // The runner made the workspace with its graphs on CUDA, where alone it captures.
                let captured = match &cache.workspace {
                    Some(w) => Graph::capture(dev, w, || self.graph_body(&key, statics, &padded).map(|_| ())),
                    None => Err(candle_core::Error::Msg("no cuBLAS workspace for the capture".into())),
                };
                match captured {
                    Ok(g) => {
                        g.launch()?;
                        // Counted for the metrics only: a driver that cannot list them counts none.
                        cache.nodes += g.nodes().unwrap_or_default();
                        entry.phase = Phase::Ready(g);
                        cache.captures += 1;
                        cache.replays += 1;
                    }
                    Err(e) => failure = Some(format!("capture: {e}")),
                }
            }
            Phase::Ready(g) => {
                g.launch()?;
                cache.replays += 1;
            }
            Phase::Failed => unreachable!("handled above"),
        }
        if let Some(msg) = failure {
            entry.phase = Phase::Failed;
            if !cache.warned {
                cache.warned = true;
                eprintln!("ponder: CUDA graph for {key:?} failed ({msg}); running that shape eagerly (reported once)");
            }
            return Ok(None);
        }
        let st = &cache.entries[&key].statics;
        let n = launch.rows.len();
        let gate_logits = st.has_gate.then(|| st.gate.narrow(1, 0, n)).transpose()?;
        let logits = st.logits.as_ref().map(|l| l.narrow(0, 0, n)).transpose()?;
        Ok(Some(match key.stage {
            Stage::CoreStep => Forward {
                logits: None,
                gate_logits,
                latent_diff: self.compute_latent.then(|| st.latent.narrow(0, 0, n)).transpose()?,
                sample_rows: Vec::new(),
                greedy_ids: None,
            },
            Stage::Coda => Forward {
                logits,
                gate_logits: None,
                latent_diff: None,
                sample_rows: (0..n).collect(),
                greedy_ids: st.ids.as_ref().map(|ids| ids.narrow(0, 0, n)).transpose()?,
            },
            _ => Forward { logits, gate_logits, latent_diff: None, sample_rows: (0..n).collect(), greedy_ids: None },
        }))
    }

    /// Writes a launch's host data into the static inputs of its key; returns the padded
    /// addressing of each batch, then of the re-entry batch if any (only the warm-up and the
    /// capture build batches from it).
    fn write_graph_inputs(&self, key: &GraphKey, st: &Statics, launch: &LoopedLaunch) -> Result<Vec<PagedBatchHost>> {
        let rows = &launch.rows;
        let tokens: Vec<u32> = if key.stage == Stage::FullDepthDecode { rows.iter().map(|r| r.tokens[0]).collect() } else { Vec::new() };
        let positions: Vec<u32> = rows.iter().map(|r| r.start_pos as u32).collect();
        let state: Vec<u32> = rows.iter().map(|r| r.state).collect();
        let next: Vec<u32> = if key.reenter { rows.iter().map(|r| successor_pos(r) as u32).collect() } else { Vec::new() };
        st.write_inputs(&tokens, &positions, &next, &state, self.scratch_row)?;
        let mut padded = st
            .batches
            .iter()
            .map(|(slot, buf)| {
                let table_of = |r: &LoopedRow| if key.slots.is_empty() { r.slot } else { *slot };
                buf.write(&single_token_host(rows.iter(), table_of, |r| r.start_pos), self.block_size, self.scratch_block)
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(buf) = &st.reentry {
            // The successors, in their rows' slot-0 tables, as `reenter` places them.
            padded.push(buf.write(&single_token_host(rows.iter(), |_| 0, successor_pos), self.block_size, self.scratch_block)?);
        }
        Ok(padded)
    }

    /// The head over `y` into the static `logits`: straight into them where the model writes
    /// its logits into a given buffer (a decode arena), else computed and copied.
    fn head_to(&self, y: &candle_core::Tensor, logits: &candle_core::Tensor) -> Result<()> {
        if !self.model.head_into(y, logits)? {
            logits.slice_set(&self.model.head(y)?.contiguous()?, 0, 0)?;
        }
        Ok(())
    }

    /// What a graph of `key` runs, over its static buffers only. Every tensor it makes is
    /// dropped before it returns; results go to the static outputs, the state bank and the KV
    /// cache. The bank is written last, so a failed warm-up leaves the launch re-runnable.
    /// Returns whether the model gave gate logits.
    fn graph_body(&self, key: &GraphKey, st: &Statics, padded: &[PagedBatchHost]) -> Result<bool> {
        let spec = self.model.spec();
        let kv_width = spec.num_kv_heads * spec.head_dim;
        let batches: Vec<PagedBatch> = st
            .batches
            .iter()
            .zip(padded)
            .map(|((_, buf), host)| PagedBatch::from_buffers(host.clone(), self.block_size, AttnMask::Causal, kv_width, buf, key.ctx))
            .collect::<Result<_>>()?;
        let batch_of = |slot: usize| st.batches.iter().position(|(s, _)| *s == slot).map(|i| &batches[i]).expect("a batch per slot");
        let mut has_gate = false;
        match key.stage {
            Stage::CoreStep => {
                let input = self.model.prepare(&st.positions)?;
                let h_old = self.gather_states(&st.state)?;
                let out = self.model.core_step(&h_old, &input, &batches[0], &self.kv)?;
                if self.compute_latent {
                    let latent = st.latent.narrow(0, 0, h_old.dim(0)?)?;
                    crate::ops::into::latent_change_into(&h_old, &out.hidden, self.model.spec().hidden_size, &latent)?;
                }
                if let Some(g) = &out.gate_logit {
                    st.gate.slice_set(&g.unsqueeze(0)?.contiguous()?, 0, 0)?;
                    has_gate = true;
                }
                self.write_bank(&st.state, &out.hidden)?;
            }
            Stage::FullDepthDecode => {
                let input = self.model.prepare(&st.positions)?;
                let mut h = self.model.prelude(&st.tokens, &input, batch_of(key.slots[0]), &self.kv)?;
                for (i, &slot) in key.slots.iter().enumerate() {
                    let out = self.model.core_step(&h, &input, batch_of(slot), &self.kv)?;
                    h = out.hidden;
                    if let Some(g) = &out.gate_logit {
                        st.gate.slice_set(&g.unsqueeze(0)?.contiguous()?, 0, i)?;
                        has_gate = true;
                    }
                }
                let y = self.model.coda(&h, &input, batch_of(key.slots[0]), &self.kv)?;
                self.head_to(&y, st.logits.as_ref().expect("full-depth statics hold logits"))?;
            }
            Stage::Coda => {
                let h = self.gather_states(&st.state)?;
                let input = self.model.prepare(&st.positions)?;
                let y = self.model.coda(&h, &input, batch_of(0), &self.kv)?;
                let logits = st.logits.as_ref().expect("coda statics hold logits");
                self.head_to(&y, logits)?;
                if let (Some(ids_out), Some(buf)) = (&st.ids, &st.reentry) {
                    // What `launch` does eagerly otherwise: argmax, then the successors' prelude.
                    let ids = self.greedy_ids_to(logits, ids_out)?;
                    let host = padded[st.batches.len()].clone();
                    let batch = PagedBatch::from_buffers(host, self.block_size, AttnMask::Causal, kv_width, buf, key.ctx)?;
                    let next = self.model.prepare(&st.next_positions)?;
                    let h = self.model.prelude(&ids, &next, &batch, &self.kv)?;
                    self.write_bank(&st.state, &h)?;
                }
            }
            other => candle_core::bail!("no graph for stage {other:?}"),
        }
        Ok(has_gate)
    }
}
