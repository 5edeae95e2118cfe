//! A diffusion scheduler written against the public API: every step recomputes each request's
//! whole canvas (prompt, finished blocks and the current block) — nothing cached across steps,
//! so each step is the model's exact computation over what the request has so far — and
//! reveals a fixed number of the most confident masked tokens of the current block. A block's
//! tokens stream when the block is finished. It implements `schedule`, `complete` and
//! `finished` of `DiffusionScheduler`; the engine owns the waiting queue and the KV blocks and
//! lends them to the scheduler as `Requests`.
//!
//!     cargo run --release --example custom_diffusion_scheduler

use ponder::diffusion::{DenoiseLaunch, DenoiseResult, DenoiseRow, DiffusionScheduler, Emitted};
use ponder::scheduler::{Requests, SchedulerLimits};
use ponder::{EngineBuilder, GenerationParams, RequestId};

#[derive(Debug)]
struct Canvas {
    id: RequestId,
    prompt_len: usize,
    max_new: usize,
    /// Prompt, finished blocks and the current block (masked where not yet revealed).
    tokens: Vec<u32>,
    /// First position of the current block (blocks are aligned to multiples of its length).
    block_start: usize,
    steps: usize,
}

/// Whole-canvas recomputation, `per_step` reveals per step, blocks of `block`.
#[derive(Debug)]
pub struct WholeCanvas {
    limits: SchedulerLimits,
    running: Vec<Canvas>,
    block: usize,
    per_step: usize,
    mask: u32,
    /// Logits at position `i` predict token `i + 1` (Dream): a masked token reads its left
    /// neighbour's.
    shift: usize,
}

impl WholeCanvas {
    pub fn new(limits: SchedulerLimits, block: usize, per_step: usize, mask: u32, shift_logits: bool) -> Self {
        Self { limits, running: Vec::new(), block, per_step: per_step.max(1), mask, shift: shift_logits as usize }
    }

    fn block_end(&self, c: &Canvas) -> usize {
        c.block_start + self.block
    }

    fn row(&self, requests: &Requests, c: &Canvas) -> DenoiseRow {
        let end = self.block_end(c);
        let readout = (c.block_start.max(c.prompt_len)..end).filter(|&p| c.tokens[p] == self.mask).map(|p| (p - self.shift) as u32).collect();
        let table = requests.tables(c.id).expect("admitted").first().expect("one slot").clone();
        DenoiseRow::new(c.id, c.tokens[..end].to_vec(), (0..end as u32).collect(), readout, table)
    }
}

impl DiffusionScheduler for WholeCanvas {
    fn name(&self) -> &'static str {
        "whole-canvas"
    }
    /// Whole blocks: the last block may run past `prompt + max_new_tokens`.
    fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        (prompt_len + max_new_tokens).div_ceil(self.block) * self.block
    }

    fn schedule(&mut self, requests: &mut Requests) -> Option<DenoiseLaunch> {
        let mut tokens: usize = self.running.iter().map(|c| self.block_end(c)).sum();
        while self.running.len() < self.limits.max_num_seqs {
            let Some(next) = requests.front() else { break };
            let need = self.kv_positions(next.prompt.len(), next.max_new_tokens);
            let first = (next.prompt.len() / self.block + 1) * self.block;
            if !self.running.is_empty() && tokens + first > self.limits.max_num_batched_tokens {
                break;
            }
            let Some(r) = requests.admit_front(need) else { break };
            let mut c = Canvas {
                id: r.id,
                prompt_len: r.prompt.len(),
                max_new: r.max_new_tokens,
                block_start: r.prompt.len() / self.block * self.block,
                tokens: r.prompt,
                steps: 0,
            };
            c.tokens.resize(self.block_end(&c), self.mask);
            tokens += first;
            self.running.push(c);
        }
        let rows: Vec<DenoiseRow> = self.running.iter().map(|c| self.row(requests, c)).collect();
        (!rows.is_empty()).then_some(DenoiseLaunch { rows })
    }

    fn finished(&mut self, id: RequestId) {
        self.running.retain(|c| c.id != id);
    }

    fn complete(&mut self, _requests: &mut Requests, launch: &DenoiseLaunch, result: &DenoiseResult) -> Vec<Emitted> {
        let mut emitted = Vec::new();
        for (row, out) in launch.rows.iter().zip(&result.rows) {
            let (block, per_step, shift) = (self.block, self.per_step, self.shift);
            let Some(c) = self.running.iter_mut().find(|c| c.id == row.request) else { continue };
            // Most confident first; every remaining mask on the block's last allowed step.
            let mut cands: Vec<(usize, u32, f32)> = row.readout.iter().zip(&out.candidates).map(|(&i, &(t, p))| (i as usize + shift, t, p)).collect();
            cands.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)));
            c.steps += 1;
            let take = if c.steps >= block.div_ceil(per_step) { cands.len() } else { per_step.min(cands.len()) };
            for &(pos, token, _) in &cands[..take] {
                c.tokens[pos] = token;
            }
            let end = c.block_start + block;
            if c.tokens[c.block_start.max(c.prompt_len)..end].contains(&self.mask) {
                continue;
            }
            // Block finished: stream it (within max_new_tokens) and open the next one.
            let from = c.block_start.max(c.prompt_len);
            let done = (end - c.prompt_len).min(c.max_new);
            let upto = (c.prompt_len + done).max(from);
            emitted.push(Emitted::new(c.id, c.tokens[from..upto].to_vec()));
            if done < c.max_new {
                c.block_start = end;
                c.tokens.resize(end + block, self.mask);
                c.steps = 0;
            }
        }
        emitted
    }
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut engine = EngineBuilder::new(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-sdar"))
        .max_num_seqs(2)
        .diffusion(|o| {
            o.custom_scheduler(|ctx| {
                let (block, mask, shift) = (ctx.config.block_length, ctx.spec.mask_token_id, ctx.spec.shift_logits);
                Box::new(WholeCanvas::new(ctx.limits, block, 4, mask, shift))
            })
        })
        .build()?;
    let prompts = ["fn main() {", "Ownership in Rust"];
    for out in engine.generate(prompts, &GenerationParams::greedy(32))? {
        let out = out?;
        println!("{} (request {}): {}", engine.scheduler_name(), out.id, out.text.trim());
    }
    Ok(())
}
