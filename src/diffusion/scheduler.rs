//! Block-diffusion scheduling with continuous batching across requests, first done first out.
//!
//! Every running request contributes its current block to each denoise launch (ragged: only the
//! positions its delayed cache recomputes); a request whose block completes moves to its next
//! block (or leaves) without waiting for the others, and waiting requests join at any step while
//! the width and the KV pool allow. The unmask policy decides, on the host, which masked tokens
//! become final; revealed tokens stream out as soon as they extend the request's final prefix.
//!
//! Row kinds in one launch (the runner treats them alike, the mask makes them exact):
//! - **prefill** (block-causal models): the prompt's complete blocks, written once, in chunks of
//!   whole blocks within the launch budget (`max_num_batched_tokens`) left after the step rows of
//!   the requests already decoding — at least one block per launch, so a long prompt advances
//!   while every decoding request still steps in every launch;
//! - **commit** (block-causal models): a completed block rerun with its final tokens so its
//!   K/V are clean before later blocks read them; it rides along with the next block's first step;
//! - **step**: the recomputed positions of the current block, reading out its masked tokens.
//!
//! Bidirectional models (LLaDA, Dream) decode a canvas of the prompt followed by every position
//! the request may generate, all masked at first; blocks start at the prompt's end and nothing
//! right of the current block is revealed early. What a step runs is the [`CanvasCache`]: the
//! whole canvas (exact, the default), or from a block's second step on only the block and the
//! masked suffix (prefix cache) or only the block (dual cache). With `whole_region` the whole
//! generation is one block (Dream's own sampler).

use super::{DenoiseLaunch, DenoiseResult, DenoiseRow, DiffusionScheduler, Emitted, EvictRow};
use crate::diffusion::{BlockCanvas, Candidate, CanvasCache, DiffusionAttention, StepContext, UnmaskPolicy};
use crate::request::RequestId;
use crate::scheduler::{Requests, SchedRequest, SchedulerLimits};
use std::collections::HashMap;

/// How blocks are decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiffusionConfig {
    pub block_length: usize,
    /// Steps after which a block's remaining masked tokens are all revealed.
    pub max_steps_per_block: usize,
    /// Recompute only positions that are masked or whose right neighbour was masked a step ago.
    pub delayed_cache: bool,
    pub mask_token_id: u32,
    pub attention: DiffusionAttention,
    /// Logits at position `i` predict token `i + 1` (Dream).
    pub shift_logits: bool,
    /// Step rows carry the block state an eviction policy needs ([`EvictRow`]).
    pub eviction: bool,
    /// Bidirectional models: what a step recomputes.
    pub cache: CanvasCache,
    /// Bidirectional models: the whole generation region is one block (Dream's sampler);
    /// `block_length` is then unused.
    pub whole_region: bool,
}

impl DiffusionConfig {
    fn bidirectional(&self) -> bool {
        self.attention == DiffusionAttention::Bidirectional
    }

    /// Cache positions a request of `prompt_len` prompt tokens and `max_new_tokens` needs at
    /// most. Block-causal blocks are aligned to the canvas start, so the last one may reach past
    /// the generation; bidirectional blocks start at the prompt's end and stop at its last
    /// position.
    pub fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        let n = prompt_len + max_new_tokens;
        if self.bidirectional() {
            n
        } else {
            n.div_ceil(self.block_length) * self.block_length
        }
    }
}

#[derive(Debug)]
struct Running {
    id: RequestId,
    prompt_len: usize,
    max_new: usize,
    /// Final tokens before the current block.
    history: Vec<u32>,
    canvas: BlockCanvas,
    /// Blocks started before the current one.
    block_index: usize,
    /// Generated tokens handed to the engine.
    emitted: usize,
    /// The prompt's complete blocks `[0, prefill_to)` are prefilled in chunks (block-causal
    /// models; 0 for bidirectional ones); K/V are written up to `prefilled`.
    prefill_to: usize,
    prefilled: usize,
    /// A completed block whose clean K/V the next launch writes: `(start, tokens)`.
    commit_pending: Option<(usize, Vec<u32>)>,
    /// This block: tokens decoded, steps that decoded any, rightmost offset run through every
    /// layer (FOCUS's ā and block_progress).
    decoded: u32,
    decoding_steps: u32,
    block_progress: i64,
}

impl Running {
    /// The canvas token at `pos`: final history, the current block, or a mask beyond it.
    fn token_at(&self, pos: usize, mask_id: u32) -> u32 {
        let s = self.canvas.start();
        if pos < s {
            self.history[pos]
        } else if pos < self.canvas.end() {
            self.canvas.tokens()[pos - s]
        } else {
            mask_id
        }
    }

    /// One past the last position the request may generate.
    fn canvas_end(&self) -> usize {
        self.prompt_len + self.max_new
    }
}

/// The block-diffusion scheduler. See the module docs.
pub struct DiffusionBatching {
    cfg: DiffusionConfig,
    limits: SchedulerLimits,
    policy: Box<dyn UnmaskPolicy>,
    running: Vec<Running>,
    emitted: Vec<Emitted>,
    /// Tokens revealed under an eviction policy, and of them those in the step's kept set.
    revealed: u64,
    revealed_kept: u64,
}

impl DiffusionBatching {
    pub fn new(cfg: DiffusionConfig, limits: SchedulerLimits, policy: Box<dyn UnmaskPolicy>) -> Self {
        Self { cfg, limits, policy, running: Vec::new(), emitted: Vec::new(), revealed: 0, revealed_kept: 0 }
    }

    pub fn config(&self) -> &DiffusionConfig {
        &self.cfg
    }
    pub fn policy(&self) -> &dyn UnmaskPolicy {
        self.policy.as_ref()
    }

    /// Length of a bidirectional request's block starting at `start`: the block length, the
    /// whole generation region, or what is left of the region.
    fn block_len_at(&self, start: usize, prompt_len: usize, max_new: usize) -> usize {
        let left = prompt_len + max_new - start;
        if self.cfg.whole_region {
            left
        } else {
            self.cfg.block_length.min(left)
        }
    }

    fn start(&self, r: SchedRequest) -> Running {
        let b = self.cfg.block_length;
        let p = r.prompt.len();
        let block_causal = !self.cfg.bidirectional();
        let canvas = if block_causal {
            let start = p / b * b;
            BlockCanvas::new(start, b, &r.prompt[start..], self.cfg.mask_token_id, self.cfg.delayed_cache)
        } else {
            BlockCanvas::new(p, self.block_len_at(p, p, r.max_new_tokens), &[], self.cfg.mask_token_id, self.cfg.delayed_cache)
        };
        let start = canvas.start();
        let mut history = r.prompt;
        history.truncate(start);
        let prefill_to = if block_causal { start } else { 0 };
        Running {
            id: r.id,
            prompt_len: p,
            max_new: r.max_new_tokens,
            history,
            canvas,
            block_index: 0,
            emitted: 0,
            prefill_to,
            prefilled: 0,
            commit_pending: None,
            decoded: 0,
            decoding_steps: 0,
            block_progress: -1,
        }
    }

    /// The next prefill chunk of `req`: whole blocks within `budget` (taken from it), or one
    /// block if `budget` holds less and no chunk has been taken this launch (`chunked`).
    fn prefill_chunk(&self, requests: &Requests, req: &mut Running, budget: &mut usize, chunked: &mut bool) -> Option<DenoiseRow> {
        let b = self.cfg.block_length;
        let remaining = req.prefill_to - req.prefilled;
        let mut n = (*budget / b * b).min(remaining);
        if n == 0 && !*chunked {
            n = b.min(remaining);
        }
        if n == 0 {
            return None;
        }
        *budget = budget.saturating_sub(n);
        *chunked = true;
        let table = requests.tables(req.id).expect("running request holds KV")[0].clone();
        let row = DenoiseRow::run(req.id, req.history[req.prefilled..req.prefilled + n].to_vec(), req.prefilled, table);
        req.prefilled += n;
        Some(row)
    }

    /// Rows of a prefilling request for the next launch: its next chunk, and once the prompt is
    /// written, its first step.
    fn prefill_rows(&self, requests: &Requests, req: &mut Running, budget: &mut usize, chunked: &mut bool) -> Vec<DenoiseRow> {
        let mut rows: Vec<DenoiseRow> = self.prefill_chunk(requests, req, budget, chunked).into_iter().collect();
        if req.prefilled == req.prefill_to {
            let step = self.rows_for(requests, req);
            *budget = budget.saturating_sub(step.iter().map(|r| r.tokens.len()).sum());
            rows.extend(step);
        }
        rows
    }

    /// The rows a request past its prefill contributes to the next launch; clears its pending
    /// commit.
    fn rows_for(&self, requests: &Requests, req: &mut Running) -> Vec<DenoiseRow> {
        let table = requests.tables(req.id).expect("running request holds KV")[0].clone();
        let mut rows = Vec::with_capacity(2);
        if let Some((start, tokens)) = req.commit_pending.take() {
            rows.push(DenoiseRow::run(req.id, tokens, start, table.clone()));
        }
        if req.canvas.is_done() {
            return rows; // waiting for the engine to finish it
        }
        let c = &req.canvas;
        let s = c.start();
        let block: Vec<usize> = c.processing().into_iter().map(|o| s + o).collect();
        let end = req.canvas_end();
        let mut context = None;
        let mut positions: Vec<usize> = match (self.cfg.bidirectional(), self.cfg.cache) {
            (false, _) => block,
            (true, CanvasCache::Exact) => (0..end).collect(),
            (true, _) if c.steps() == 0 => (0..end).collect(),
            (true, CanvasCache::Prefix) => block.into_iter().chain(c.end()..end).collect(),
            (true, CanvasCache::Dual) => {
                context = Some(end as u32);
                block
            }
        };
        let shift = self.cfg.shift_logits as usize;
        if shift == 1 && s > 0 && c.is_masked(0) && positions[0] == s {
            positions.insert(0, s - 1);
        }
        let readout = c
            .masked_offsets()
            .into_iter()
            .map(|o| positions.binary_search(&(s + o - shift)).expect("a masked token's logit source is recomputed") as u32)
            .collect();
        let tokens = positions.iter().map(|&p| req.token_at(p, self.cfg.mask_token_id)).collect();
        let mut row = DenoiseRow::new(req.id, tokens, positions.into_iter().map(|p| p as u32).collect(), readout, table);
        row.context = context;
        if self.cfg.eviction {
            row.evict = Some(EvictRow { block_start: s as u32, decoded: req.decoded, decoding_steps: req.decoding_steps, block_progress: req.block_progress });
        }
        rows.push(row);
        rows
    }

    /// Reveals a step's tokens, streams the final prefix and moves to the next block.
    fn apply_step(&mut self, idx: usize, row: &DenoiseRow, cands: &[(u32, f32)], kept: Option<&[u32]>) {
        let shift = self.cfg.shift_logits as usize;
        let req = &self.running[idx];
        let s = req.canvas.start();
        let positions = &row.positions;
        // Candidates line up with the readout, or with its kept part when tokens were evicted.
        let sources: Vec<u32> = match kept {
            Some(k) if cands.len() < row.readout.len() => row.readout.iter().copied().filter(|i| k.contains(i)).collect(),
            _ => row.readout.clone(),
        };
        let candidates: Vec<Candidate> = sources
            .iter()
            .zip(cands)
            .map(|(&i, &(token, confidence))| Candidate { offset: positions[i as usize] as usize + shift - s, token, confidence })
            .collect();
        let pushed_through = kept.map(|k| k.iter().map(|&i| positions[i as usize] as i64 - s as i64).max().unwrap_or(-1));
        if candidates.is_empty() {
            return;
        }
        let ctx = StepContext {
            request: req.id,
            block: req.block_index,
            step: req.canvas.steps(),
            masked: req.canvas.num_masked(),
            block_masked: req.canvas.initially_masked(),
            block_len: req.canvas.len(),
        };
        let mut pick = if ctx.step + 1 >= self.cfg.max_steps_per_block { (0..candidates.len()).collect() } else { self.policy.select(&ctx, &candidates) };
        pick.retain(|&i| i < candidates.len());
        pick.sort_unstable();
        pick.dedup();
        if pick.is_empty() && !self.policy.may_reveal_none() {
            pick.extend(crate::diffusion::by_confidence(&candidates).first());
        }
        let reveals: Vec<(usize, u32)> = pick.iter().map(|&i| (candidates[i].offset, candidates[i].token)).collect();
        if let Some(k) = kept {
            let kept_offsets: Vec<usize> = k.iter().map(|&i| positions[i as usize] as usize + shift - s).collect();
            self.revealed += reveals.len() as u64;
            self.revealed_kept += reveals.iter().filter(|(o, _)| kept_offsets.contains(o)).count() as u64;
        }
        let b = self.cfg.block_length;
        let block_causal = self.cfg.attention == DiffusionAttention::BlockCausal;
        let (mask_id, delayed) = (self.cfg.mask_token_id, self.cfg.delayed_cache);
        let req = &mut self.running[idx];
        req.canvas.reveal(&reveals);
        req.decoded += reveals.len() as u32;
        req.decoding_steps += 1;
        if let Some(right) = pushed_through {
            req.block_progress = req.block_progress.max(right);
        }
        // Stream the longest final run past what was handed out.
        let (mut out, mut steps) = (Vec::new(), Vec::new());
        let mut pos = req.prompt_len + req.emitted;
        while req.emitted + out.len() < req.max_new && pos < req.canvas.end() && !req.canvas.is_masked(pos - s) {
            out.push(req.canvas.tokens()[pos - s]);
            steps.push(req.canvas.revealed_at(pos - s));
            pos += 1;
        }
        req.emitted += out.len();
        let (id, next, prompt_len, max_new) = (req.id, req.canvas.end(), req.prompt_len, req.max_new);
        let block_done = req.canvas.is_done() && req.emitted < req.max_new;
        if !out.is_empty() {
            self.emitted.push(Emitted { request: id, tokens: out, steps });
        }
        if block_done {
            let len = if block_causal { b } else { self.block_len_at(next, prompt_len, max_new) };
            let req = &mut self.running[idx];
            let done = std::mem::replace(&mut req.canvas, BlockCanvas::new(next, len, &[], mask_id, delayed));
            req.history.extend_from_slice(done.tokens());
            req.block_index += 1;
            (req.decoded, req.decoding_steps, req.block_progress) = (0, 0, -1);
            if block_causal {
                req.commit_pending = Some((s, done.tokens().to_vec()));
            }
        }
    }
}

impl DiffusionScheduler for DiffusionBatching {
    fn name(&self) -> &'static str {
        "diffusion"
    }

    fn finished(&mut self, id: RequestId) {
        self.running.retain(|r| r.id != id);
    }

    fn revealed_in_kept(&self) -> Option<(u64, u64)> {
        self.cfg.eviction.then_some((self.revealed, self.revealed_kept))
    }

    fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        self.cfg.kv_positions(prompt_len, max_new_tokens)
    }

    fn schedule(&mut self, requests: &mut Requests) -> Option<DenoiseLaunch> {
        let mut rows = Vec::new();
        let mut running = std::mem::take(&mut self.running);
        // Requests already decoding step in every launch; prefill chunks share what is left of
        // the budget.
        for req in running.iter_mut().filter(|r| r.prefilled == r.prefill_to) {
            rows.extend(self.rows_for(requests, req));
        }
        let mut budget = self.limits.max_num_batched_tokens.saturating_sub(rows.iter().map(|r: &DenoiseRow| r.tokens.len()).sum());
        let mut chunked = false;
        for req in running.iter_mut().filter(|r| r.prefilled < r.prefill_to) {
            rows.extend(self.prefill_rows(requests, req, &mut budget, &mut chunked));
        }
        // Admit first come first served while the width, the budget and the KV pool allow. A
        // block-causal request's first launch can be one block of prefill; a bidirectional one's
        // is its whole canvas, which cannot be split.
        let b = self.cfg.block_length;
        while running.len() < self.limits.max_num_seqs {
            let Some(next) = requests.front() else {
                break;
            };
            let need = self.cfg.kv_positions(next.prompt.len(), next.max_new_tokens);
            let first_launch = match self.cfg.attention {
                DiffusionAttention::BlockCausal => b + 1,
                DiffusionAttention::Bidirectional => next.prompt.len() + next.max_new_tokens,
            };
            if !running.is_empty() && first_launch > budget {
                break;
            }
            let Some(r) = requests.admit_front(need) else {
                break;
            };
            let mut req = self.start(r);
            rows.extend(self.prefill_rows(requests, &mut req, &mut budget, &mut chunked));
            running.push(req);
        }
        self.running = running;
        if rows.is_empty() {
            return None;
        }
        Some(DenoiseLaunch { rows })
    }

    fn complete(&mut self, _requests: &mut Requests, launch: &DenoiseLaunch, result: &DenoiseResult) -> Vec<Emitted> {
        // Steps never add or remove running requests, so positions hold for the whole launch.
        let index: HashMap<RequestId, usize> = self.running.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
        for (row, out) in launch.rows.iter().zip(&result.rows) {
            if row.readout.is_empty() {
                continue;
            }
            if let Some(&idx) = index.get(&row.request) {
                self.apply_step(idx, row, &out.candidates, out.kept.as_deref());
            }
        }
        std::mem::take(&mut self.emitted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diffusion::DenoiseRowOutput;
    use crate::diffusion::{StaticCount, Threshold};
    use crate::kv::KvManager;

    /// The scheduler driven as the engine core drives it.
    struct Driven {
        s: DiffusionBatching,
        requests: Requests,
    }

    impl Driven {
        fn add(&mut self, r: SchedRequest) {
            self.requests.add(r);
        }
        fn schedule(&mut self) -> Option<DenoiseLaunch> {
            self.s.schedule(&mut self.requests)
        }
        fn complete(&mut self, launch: &DenoiseLaunch, result: &DenoiseResult) -> Vec<Emitted> {
            self.s.complete(&mut self.requests, launch, result)
        }
        fn finish(&mut self, id: RequestId) {
            self.requests.end(id);
            self.s.finished(id);
        }
        fn kv(&self) -> &KvManager {
            self.requests.kv()
        }
    }

    fn sched(attention: DiffusionAttention, delayed: bool, shift: bool, per_step: usize) -> Driven {
        let cfg = DiffusionConfig {
            block_length: 4,
            max_steps_per_block: 4,
            delayed_cache: delayed,
            mask_token_id: 99,
            attention,
            shift_logits: shift,
            eviction: false,
            cache: CanvasCache::Exact,
            whole_region: false,
        };
        let kv = KvManager::new(64, 4, 1);
        Driven {
            s: DiffusionBatching::new(cfg, SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 256 }, Box::new(StaticCount::new(per_step).unwrap())),
            requests: Requests::new(kv),
        }
    }

    /// Answers every readout with token = 10 + position, confidence falling with position.
    fn answer(l: &DenoiseLaunch, shift: usize) -> DenoiseResult {
        let rows = l
            .rows
            .iter()
            .map(|r| {
                let pos = &r.positions;
                let candidates = r.readout.iter().map(|&i| (10 + pos[i as usize] + shift as u32, 1.0 / (1.0 + pos[i as usize] as f32))).collect();
                DenoiseRowOutput::new(r.request, candidates)
            })
            .collect();
        DenoiseResult { rows, ..Default::default() }
    }

    fn run(s: &mut Driven, shift: usize) -> (Vec<DenoiseLaunch>, HashMap<RequestId, Vec<u32>>) {
        let mut launches = Vec::new();
        let mut out: HashMap<RequestId, Vec<u32>> = HashMap::new();
        while let Some(l) = s.schedule() {
            let res = answer(&l, shift);
            for e in s.complete(&l, &res) {
                let o = out.entry(e.request).or_default();
                o.extend(e.tokens);
            }
            let finished: Vec<RequestId> = s.s.running.iter().filter(|r| r.emitted >= r.max_new).map(|r| r.id).collect();
            for id in finished {
                s.finish(id);
            }
            launches.push(l);
            assert!(launches.len() < 100);
        }
        (launches, out)
    }

    #[test]
    fn block_causal_prefills_commits_and_streams() {
        let mut s = sched(DiffusionAttention::BlockCausal, false, false, 2);
        s.add(SchedRequest { id: RequestId(0), prompt: vec![1, 2, 3, 4, 5, 6], max_new_tokens: 6 });
        let (launches, out) = run(&mut s, 0);
        // Prompt 6 = one complete block [0,4) + 2 prompt tokens in the first decode block [4,8).
        let first = &launches[0];
        assert_eq!(first.rows.len(), 2);
        assert_eq!(first.rows[0].positions, vec![0, 1, 2, 3]);
        assert!(first.rows[0].readout.is_empty());
        assert_eq!(first.rows[1].positions, vec![4, 5, 6, 7]);
        assert_eq!(first.rows[1].tokens, vec![5, 6, 99, 99]);
        assert_eq!(first.rows[1].readout, vec![2, 3]);
        // 2 per step: block [4,8) done after one step; the next launch commits it and starts [8,12).
        let second = &launches[1];
        assert_eq!(second.rows[0].positions, vec![4, 5, 6, 7]);
        assert_eq!(second.rows[0].tokens, vec![5, 6, 16, 17]);
        assert!(second.rows[0].readout.is_empty());
        assert_eq!(second.rows[1].tokens, vec![99; 4]);
        assert_eq!(out[&RequestId(0)], vec![16, 17, 18, 19, 20, 21]);
        assert_eq!(s.kv().num_used_blocks(), 0);
    }

    #[test]
    fn delayed_cache_recomputes_only_unfrozen_positions() {
        let mut s = sched(DiffusionAttention::BlockCausal, true, false, 1);
        s.add(SchedRequest { id: RequestId(0), prompt: vec![1, 2, 3, 4], max_new_tokens: 4 });
        let (launches, out) = run(&mut s, 0);
        let sets: Vec<Vec<u32>> = launches.iter().map(|l| l.rows.last().unwrap().positions.clone()).collect();
        // One token per step, most confident = leftmost: 4, 5, 6, 7.
        assert_eq!(sets[0], vec![4, 5, 6, 7]);
        assert_eq!(sets[1], vec![4, 5, 6, 7]);
        assert_eq!(sets[2], vec![4, 5, 6, 7], "4 freezes one step after 5 is revealed");
        assert_eq!(sets[3], vec![5, 6, 7]);
        assert_eq!(sets.len(), 4);
        assert_eq!(out[&RequestId(0)], vec![14, 15, 16, 17]);
    }

    #[test]
    fn bidirectional_exact_runs_the_whole_canvas_with_blocks_from_the_prompt_end() {
        let mut s = sched(DiffusionAttention::Bidirectional, false, true, 4);
        s.add(SchedRequest { id: RequestId(0), prompt: vec![1, 2, 3, 4, 5], max_new_tokens: 7 });
        let (launches, out) = run(&mut s, 1);
        assert_eq!(launches.len(), 2, "blocks [5, 9) and [9, 12), one step each");
        for l in &launches {
            assert_eq!(l.rows.len(), 1, "no prefill row for bidirectional models");
            assert_eq!(l.rows[0].positions, (0..12).collect::<Vec<u32>>(), "every step runs the whole canvas");
        }
        assert_eq!(launches[0].rows[0].tokens, [vec![1, 2, 3, 4, 5], vec![99; 7]].concat(), "prompt, then every generated position masked");
        // Masked 5..8 read the logits of their left neighbours 4..7; the suffix is never read out.
        assert_eq!(launches[0].rows[0].readout, vec![4, 5, 6, 7]);
        assert_eq!(launches[1].rows[0].tokens, [vec![1, 2, 3, 4, 5, 15, 16, 17, 18], vec![99; 3]].concat());
        assert_eq!(launches[1].rows[0].readout, vec![8, 9, 10], "the last block is what is left: 3 positions");
        assert_eq!(out[&RequestId(0)], (15..22).collect::<Vec<u32>>());
        assert_eq!(s.s.kv_positions(5, 7), 12, "no rounding to whole blocks");
    }

    #[test]
    fn prefix_and_dual_caches_run_less_after_a_blocks_first_step() {
        for cache in [CanvasCache::Prefix, CanvasCache::Dual] {
            let mut s = sched(DiffusionAttention::Bidirectional, false, true, 1);
            s.s.cfg.cache = cache;
            s.add(SchedRequest { id: RequestId(0), prompt: vec![1, 2, 3, 4, 5], max_new_tokens: 7 });
            let (launches, out) = run(&mut s, 1);
            let first = &launches[0].rows[0];
            assert_eq!(first.positions, (0..12).collect::<Vec<u32>>(), "{cache:?}: a block's first step runs the whole canvas");
            let second = &launches[1].rows[0];
            match cache {
                // Position 5 was revealed first, so no left neighbour is needed for a shifted logit.
                CanvasCache::Prefix => assert_eq!(second.positions, (5..12).collect::<Vec<u32>>(), "the block and the masked suffix"),
                _ => {
                    assert_eq!(second.positions, (5..9).collect::<Vec<u32>>(), "the block only");
                    assert_eq!(second.context_len(), 12, "and it still sees the cached suffix");
                }
            }
            assert_eq!(out[&RequestId(0)], (15..22).collect::<Vec<u32>>(), "{cache:?}");
        }
    }

    #[test]
    fn dream_timesteps_may_reveal_nothing_and_the_whole_region_is_one_block() {
        let mut s = sched(DiffusionAttention::Bidirectional, false, true, 1);
        s.s.cfg.whole_region = true;
        s.s.cfg.max_steps_per_block = 6;
        s.s.policy = Box::new(crate::diffusion::Timesteps::new(6, crate::diffusion::Confidence::Probability).unwrap());
        s.add(SchedRequest { id: RequestId(0), prompt: vec![1, 2], max_new_tokens: 5 });
        let (launches, out) = run(&mut s, 1);
        assert_eq!(launches.len(), 6, "six steps over one block of 5, some revealing nothing");
        assert!(launches.iter().all(|l| l.rows[0].positions == (0..7).collect::<Vec<u32>>()));
        assert_eq!(out[&RequestId(0)], (12..17).collect::<Vec<u32>>());
    }

    #[test]
    fn requests_finish_independently_and_join_every_step() {
        let mut s = sched(DiffusionAttention::BlockCausal, false, false, 1);
        s.add(SchedRequest { id: RequestId(0), prompt: vec![1; 3], max_new_tokens: 1 });
        s.add(SchedRequest { id: RequestId(1), prompt: vec![1; 3], max_new_tokens: 9 });
        let l = s.schedule().unwrap();
        assert_eq!(l.rows.len(), 2);
        let emitted: Vec<(RequestId, Vec<u32>, Vec<u32>)> = s.complete(&l, &answer(&l, 0)).into_iter().map(|e| (e.request, e.tokens, e.steps)).collect();
        assert_eq!(emitted, vec![(RequestId(0), vec![13], vec![1]), (RequestId(1), vec![13], vec![1])], "revealed at the block's first step");
        s.finish(RequestId(0));
        s.add(SchedRequest { id: RequestId(2), prompt: vec![1; 9], max_new_tokens: 2 });
        let l = s.schedule().unwrap();
        let ids: Vec<u64> = l.rows.iter().map(|r| r.request.0).collect();
        assert_eq!(ids, vec![1, 1, 2, 2], "request 1 commits and steps; request 2 joins with its prefill row");
    }

    #[test]
    fn last_step_reveals_everything_and_threshold_keeps_one() {
        let cfg = DiffusionConfig {
            block_length: 4,
            max_steps_per_block: 2,
            delayed_cache: false,
            mask_token_id: 99,
            attention: DiffusionAttention::BlockCausal,
            shift_logits: false,
            eviction: false,
            cache: CanvasCache::Exact,
            whole_region: false,
        };
        let kv = KvManager::new(16, 4, 1);
        let mut s = Driven { s: DiffusionBatching::new(cfg, SchedulerLimits::default(), Box::new(Threshold::new(0.99).unwrap())), requests: Requests::new(kv) };
        s.add(SchedRequest { id: RequestId(0), prompt: vec![7], max_new_tokens: 3 });
        let (launches, out) = run(&mut s, 0);
        assert_eq!(launches.len(), 2, "one token on step 1, the rest on the capped step 2");
        assert_eq!(out[&RequestId(0)], vec![11, 12, 13]);
    }

    #[test]
    fn long_prompt_prefills_whole_blocks_while_others_step_every_launch() {
        let mut s = sched(DiffusionAttention::BlockCausal, false, false, 1);
        s.s.limits.max_num_batched_tokens = 10;
        s.add(SchedRequest { id: RequestId(0), prompt: vec![1; 3], max_new_tokens: 40 });
        let l = s.schedule().unwrap();
        s.complete(&l, &answer(&l, 0));
        s.add(SchedRequest { id: RequestId(1), prompt: vec![2; 38], max_new_tokens: 3 });
        let mut chunks = Vec::new();
        loop {
            let l = s.schedule().unwrap();
            assert!(l.rows.iter().any(|r| r.request == RequestId(0) && !r.readout.is_empty()), "request 0 steps in every launch");
            let mine: Vec<&DenoiseRow> = l.rows.iter().filter(|r| r.request == RequestId(1)).collect();
            chunks.extend(mine.iter().filter(|r| r.readout.is_empty()).map(|r| (r.positions[0], r.positions.len())));
            let stepping = mine.iter().any(|r| !r.readout.is_empty());
            s.complete(&l, &answer(&l, 0));
            if stepping {
                break;
            }
        }
        // 9 complete prompt blocks: request 0's step takes 4 of the 10 tokens, leaving one block.
        assert_eq!(chunks, (0..9).map(|b| (4 * b, 4)).collect::<Vec<_>>());
    }
}
