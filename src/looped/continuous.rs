//! Continuous batching at full depth: the CB baseline of the CDB paper.
//!
//! Each tick is either a prefill launch or one decode launch over every decoding request,
//! where each row runs the prelude, all r_max loop steps and the coda. When a running request
//! cannot get a KV block, the most recently admitted one is preempted: its blocks are freed and
//! its K/V recomputed once there is room, as they were first computed so that its output does
//! not change. Where each loop step has its own cache slot a prefill over the prompt and the
//! generated tokens does that; where steps share a slot (a token's K/V there depend on whether
//! the tokens before it were computed in the same launch), the prompt is prefilled whole again and
//! the generated tokens are replayed one per decode launch, without sampling.
//!
//! Prefill is chunked: a launch holds at most `max_num_batched_tokens` prompt tokens, taken
//! first from requests whose prompt is partly computed, then from newly admitted ones. While
//! requests are decoding, a prefill launch is always followed by a decode launch, so no decode
//! waits longer than one chunk. A request's KV is reserved for its whole prompt at admission.
//!
//! While requests are decoding, a new request is admitted only once `min_free_slots` resident
//! slots are free (or every waiting request fits) — the depth scheduler's rule, so both
//! baselines batch their full-depth prefills alike instead of one small prefill per finished
//! request.

use super::admission::{admits_prefill, prefill_chunk, prefills_whole_prompts};
use super::layout::KvLayout;
use super::{LoopedLaunch, LoopedResult, LoopedRow, LoopedScheduler, Stage};
use crate::request::RequestId;
use crate::scheduler::{Requests, SchedRequest, SchedulerLimits};
use std::collections::HashMap;

#[derive(Debug)]
struct Seq {
    id: RequestId,
    /// Prompt followed by every token generated so far.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache (or being written by the launch in flight).
    computed: usize,
    /// Tokens its prefill covers: the prompt (after a preemption where each loop step has its
    /// own cache slot, with what it had generated; otherwise those are replayed one at a time).
    prefill_len: usize,
}

impl Seq {
    /// Tokens without K/V: the rest of the prompt while prefilling, one (the last sampled
    /// token) while decoding.
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
    fn prefilling(&self) -> bool {
        self.computed < self.prefill_len
    }
}

/// The full-depth continuous batching scheduler.
#[derive(Debug)]
pub struct ContinuousBatching {
    limits: SchedulerLimits,
    /// Which cache slot each loop step reads and writes.
    layout: Box<dyn KvLayout>,
    max_steps: usize,
    running: Vec<Seq>,
    /// `None`: `max(1, max_num_seqs / 16)`, as in [`super::DepthConfig::min_free_slots`].
    min_free_slots: Option<usize>,
    /// Preempted requests whose generated tokens are replayed one per decode launch: the length
    /// of the prompt their prefill covers.
    replay_from: HashMap<RequestId, usize>,
    /// The last launch was a prefill: decode goes next if anything decodes.
    last_was_prefill: bool,
}

impl ContinuousBatching {
    /// For a model of `max_steps` loop steps whose requests hold a block table per slot of
    /// `layout`.
    pub fn new(limits: SchedulerLimits, layout: Box<dyn KvLayout>, max_steps: usize) -> Self {
        Self { limits, layout, max_steps, running: Vec::new(), min_free_slots: None, replay_from: HashMap::new(), last_was_prefill: false }
    }

    /// Admit a prefill while others decode only once this many resident slots are free (or
    /// every waiting request fits). `None`: `max(1, max_num_seqs / 16)`; `Some(1)` admits as
    /// soon as any slot frees.
    pub fn with_min_free_slots(mut self, n: Option<usize>) -> Self {
        self.min_free_slots = n;
        self
    }

    /// Loop steps share a cache slot: prompts are prefilled whole (see [`prefill_chunk`]).
    fn whole_prompts(&self) -> bool {
        prefills_whole_prompts(self.layout.num_slots(self.max_steps), self.max_steps)
    }

    fn step_slots(&self) -> Vec<usize> {
        (0..self.max_steps).map(|s| self.layout.slot_for_step(s)).collect()
    }

    /// The row computing the next `n` pending tokens of `seq`; it samples when they are the last.
    fn row(&self, requests: &Requests, seq: &Seq, n: usize) -> LoopedRow {
        let tokens = seq.tokens[seq.computed..seq.computed + n].to_vec();
        let mut row = LoopedRow::full_depth(seq.id, tokens, seq.computed, requests.tables(seq.id).expect("reserved").to_vec());
        row.sample = n == seq.pending();
        row
    }

    /// One prefill launch of at most `max_num_batched_tokens` tokens: the next chunks of
    /// partly prefilled prompts first, then the first chunks of newly admitted requests.
    fn schedule_prefill(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        let mut rows = Vec::new();
        let mut budget = self.limits.max_num_batched_tokens;
        let whole = self.whole_prompts();
        for seq in self.running.iter().filter(|s| s.prefilling()) {
            let n = prefill_chunk(seq.pending(), budget, whole, rows.is_empty());
            if n == 0 {
                break;
            }
            budget -= n.min(budget);
            rows.push(self.row(requests, seq, n));
        }
        let free = self.limits.max_num_seqs.saturating_sub(self.running.len());
        let admitting = admits_prefill(&self.limits, self.min_free_slots, !self.running.is_empty(), free, requests.num_waiting());
        while admitting && budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(next) = requests.front() else {
                break;
            };
            let len = next.prompt.len();
            let prefill_len = self.replay_from.get(&next.id).copied().unwrap_or(len);
            let n = prefill_chunk(prefill_len, budget, whole, rows.is_empty());
            if n == 0 {
                break;
            }
            // Leave every running request room to grow by one block per slot, so admitting
            // this one does not force a preemption on the very next decode.
            let kv = requests.kv();
            let headroom = self.running.len() * kv.num_slots();
            if kv.blocks_missing(next.id, len) + headroom > kv.num_free_blocks() {
                break;
            }
            let next = requests.admit_front(len).expect("checked free blocks");
            self.replay_from.remove(&next.id);
            let seq = Seq { id: next.id, prefill_len, tokens: next.prompt, computed: 0 };
            budget -= n.min(budget);
            rows.push(self.row(requests, &seq, n));
            self.running.push(seq);
        }
        (!rows.is_empty()).then(|| LoopedLaunch { stage: Stage::Prefill, step_slots: self.step_slots(), rows, kv_copies: vec![], reenter: false })
    }

    fn schedule_decode(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        let mut i = 0;
        while i < self.running.len() {
            let (id, need) = (self.running[i].id, self.running[i].tokens.len());
            if requests.reserve(id, need) {
                i += 1;
                continue;
            }
            // Preempt the most recently admitted request (possibly this one) and retry.
            let victim = self.running.pop().expect("non-empty");
            let victim_was_current = i == self.running.len();
            // Recomputed later with what it generated so far (see the module docs).
            if self.whole_prompts() {
                self.replay_from.insert(victim.id, victim.prefill_len);
            }
            requests.preempt(SchedRequest { id: victim.id, prompt: victim.tokens, max_new_tokens: 0 });
            if victim_was_current {
                break;
            }
        }
        let rows: Vec<LoopedRow> = self.running.iter().filter(|s| !s.prefilling()).map(|s| self.row(requests, s, 1)).collect();
        if rows.is_empty() {
            return None;
        }
        Some(LoopedLaunch { stage: Stage::FullDepthDecode, step_slots: self.step_slots(), rows, kv_copies: vec![], reenter: false })
    }
}

impl LoopedScheduler for ContinuousBatching {
    fn name(&self) -> &'static str {
        "cb"
    }

    fn schedule(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        let decoding = self.running.iter().any(|s| !s.prefilling());
        let launch = match (self.last_was_prefill && decoding).then(|| self.schedule_decode(requests)).flatten() {
            Some(decode) => Some(decode),
            None => self.schedule_prefill(requests).or_else(|| self.schedule_decode(requests)),
        };
        self.last_was_prefill = launch.as_ref().is_some_and(|l| l.stage == Stage::Prefill);
        launch
    }

    fn finished(&mut self, id: RequestId) {
        self.running.retain(|s| s.id != id);
        self.replay_from.remove(&id);
    }

    fn complete(&mut self, _requests: &mut Requests, launch: &LoopedLaunch, result: &LoopedResult) {
        for (row, out) in launch.rows.iter().zip(&result.rows) {
            let Some(seq) = self.running.iter_mut().find(|s| s.id == row.request) else {
                continue;
            };
            seq.computed = row.start_pos + row.tokens.len();
            if let Some(t) = out.token {
                seq.tokens.push(t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvManager;
    use crate::looped::driven::Driven;
    use crate::looped::layout::{DepthIndexed, KvLayout, Shared};
    use crate::looped::LoopedRowOutput;

    fn req(id: u64, len: usize) -> SchedRequest {
        SchedRequest { id: RequestId(id), prompt: (0..len as u32).collect(), max_new_tokens: 8 }
    }

    fn answer(l: &LoopedLaunch, token: u32) -> LoopedResult {
        LoopedResult {
            rows: l.rows.iter().map(|r| LoopedRowOutput { token: r.sample.then_some(token), ..LoopedRowOutput::new(r.request) }).collect(),
            non_finite: vec![],
        }
    }

    #[test]
    fn prefill_then_full_depth_decode() {
        let limits = SchedulerLimits { max_num_seqs: 2, max_num_batched_tokens: 64 };
        let mut s = Driven::new(ContinuousBatching::new(limits, Box::new(DepthIndexed), 4), KvManager::new(64, 4, DepthIndexed.num_slots(4)));
        for i in 0..3 {
            s.add(req(i, 5));
        }
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::Prefill);
        assert_eq!(l.rows.len(), 2, "max_num_seqs caps admission");
        assert_eq!(l.step_slots, vec![0, 1, 2, 3]);
        assert_eq!(l.rows[0].block_tables.len(), 4);
        s.complete(&l, &answer(&l, 7));
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::FullDepthDecode);
        assert_eq!(l.rows[0].tokens, vec![7]);
        assert_eq!(l.rows[0].start_pos, 5);
        s.finish(RequestId(0));
        s.complete(&l, &answer(&l, 8));
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::Prefill);
        assert_eq!(l.rows[0].request, RequestId(2));
        s.finish(RequestId(1));
        s.finish(RequestId(2));
        assert_eq!(s.kv().num_used_blocks(), 0);
    }

    #[test]
    fn prefill_waits_for_min_free_slots_while_others_decode() {
        let limits = SchedulerLimits { max_num_seqs: 3, max_num_batched_tokens: 64 };
        let mut s = Driven::new(ContinuousBatching::new(limits, Box::new(Shared), 4).with_min_free_slots(Some(2)), KvManager::new(64, 4, Shared.num_slots(4)));
        for i in 0..6 {
            s.add(req(i, 5));
        }
        let l = s.schedule().unwrap();
        assert_eq!(l.rows.len(), 3);
        s.complete(&l, &answer(&l, 1));
        s.finish(RequestId(0));
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::FullDepthDecode, "one free slot of the two wanted: keep decoding");
        s.complete(&l, &answer(&l, 1));
        s.finish(RequestId(1));
        let l = s.schedule().unwrap();
        assert_eq!((l.stage, l.rows.len()), (Stage::Prefill, 2), "two free slots: one prefill of two");
        s.complete(&l, &answer(&l, 1));
        // With one request left waiting, one free slot is enough, once the decode that follows
        // every prefill has run.
        s.finish(RequestId(2));
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::FullDepthDecode, "a prefill is followed by a decode");
        s.complete(&l, &answer(&l, 1));
        let l = s.schedule().unwrap();
        assert_eq!((l.stage, l.rows.len()), (Stage::Prefill, 1));
    }

    #[test]
    fn preempts_youngest_when_blocks_run_out() {
        let limits = SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 64 };
        let mut s = Driven::new(ContinuousBatching::new(limits, Box::new(Shared), 4), KvManager::new(5, 4, Shared.num_slots(4)));
        s.add(req(0, 7));
        s.add(req(1, 6));
        let l = s.schedule().unwrap();
        assert_eq!(l.rows.len(), 2);
        s.complete(&l, &answer(&l, 1));
        let mut generated_1 = 1;
        loop {
            let l = s.schedule().unwrap();
            assert_eq!(l.stage, Stage::FullDepthDecode);
            if s.preemptions() == 1 {
                assert_eq!(l.rows.len(), 1);
                assert_eq!(l.rows[0].request, RequestId(0));
                break;
            }
            generated_1 += 1;
            s.complete(&l, &answer(&l, 2));
        }
        assert_eq!(s.num_waiting(), 1);
        s.finish(RequestId(0));
        // The shared slot: the prompt is prefilled whole again, without sampling, and each
        // generated token replayed by a decode row of its own, the last one sampling.
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::Prefill);
        assert_eq!((l.rows[0].tokens.len(), l.rows[0].sample), (6, false), "the prompt alone, as first computed");
        s.complete(&l, &answer(&l, 9));
        for i in 0..generated_1 {
            let l = s.schedule().unwrap();
            assert_eq!(l.stage, Stage::FullDepthDecode);
            assert_eq!((l.rows[0].tokens.len(), l.rows[0].start_pos), (1, 6 + i));
            assert_eq!(l.rows[0].sample, i + 1 == generated_1, "only the last generated token samples");
            s.complete(&l, &answer(&l, 3));
        }
        s.finish(RequestId(1));
        assert_eq!(s.kv().num_used_blocks(), 0);
    }

    #[test]
    fn with_a_slot_per_step_recompute_prefills_prompt_and_generated() {
        let limits = SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 64 };
        let mut s = Driven::new(ContinuousBatching::new(limits, Box::new(DepthIndexed), 4), KvManager::new(20, 4, DepthIndexed.num_slots(4)));
        s.add(req(0, 7));
        s.add(req(1, 6));
        let l = s.schedule().unwrap();
        s.complete(&l, &answer(&l, 1));
        let mut generated_1 = 1;
        while s.preemptions() == 0 {
            let l = s.schedule().unwrap();
            if s.preemptions() == 0 {
                generated_1 += 1;
            }
            s.complete(&l, &answer(&l, 2));
        }
        s.finish(RequestId(0));
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::Prefill);
        assert_eq!((l.rows[0].tokens.len(), l.rows[0].sample), (6 + generated_1, true), "prompt + generated in one prefill");
        s.finish(RequestId(1));
        assert_eq!(s.kv().num_used_blocks(), 0);
    }

    #[test]
    fn long_prompt_prefills_in_chunks_between_decodes() {
        let limits = SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 8 };
        let mut s = Driven::new(
            ContinuousBatching::new(limits, Box::new(DepthIndexed), 4).with_min_free_slots(Some(1)),
            KvManager::new(64, 4, DepthIndexed.num_slots(4)),
        );
        s.add(req(0, 3));
        let l = s.schedule().unwrap();
        s.complete(&l, &answer(&l, 1));
        s.add(req(1, 30));
        let mut chunks = Vec::new();
        let mut since_decode = 0;
        while chunks.iter().map(|r: &LoopedRow| r.tokens.len()).sum::<usize>() < 30 {
            let l = s.schedule().unwrap();
            if l.stage == Stage::Prefill {
                since_decode += 1;
                assert!(since_decode <= 1, "two prefill launches in a row while request 0 decodes");
                assert!(l.num_tokens() <= 8, "a launch over the budget");
                chunks.extend(l.rows.iter().cloned());
            } else {
                since_decode = 0;
                assert_eq!(l.rows.iter().map(|r| r.request).collect::<Vec<_>>(), vec![RequestId(0)], "a prefilling request does not decode");
            }
            s.complete(&l, &answer(&l, 2));
        }
        let starts: Vec<(usize, usize, bool)> = chunks.iter().map(|r| (r.start_pos, r.tokens.len(), r.sample)).collect();
        assert_eq!(starts, vec![(0, 8, false), (8, 8, false), (16, 8, false), (24, 6, true)]);
        let l = s.schedule().unwrap();
        assert_eq!((l.stage, l.rows.len()), (Stage::FullDepthDecode, 2), "both decode once the prompt is in");
        s.finish(RequestId(0));
        s.finish(RequestId(1));
        assert_eq!(s.kv().num_used_blocks(), 0);
    }

    #[test]
    fn shared_slot_layouts_prefill_whole_prompts() {
        let limits = SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 8 };
        let mut s = Driven::new(ContinuousBatching::new(limits, Box::new(Shared), 4).with_min_free_slots(Some(1)), KvManager::new(64, 4, Shared.num_slots(4)));
        s.add(req(0, 30));
        s.add(req(1, 3));
        let l = s.schedule().unwrap();
        assert_eq!((l.stage, l.rows.len(), l.num_tokens()), (Stage::Prefill, 1, 30), "alone in its launch, over the budget");
        s.complete(&l, &answer(&l, 1));
        assert_eq!(s.schedule().unwrap().stage, Stage::FullDepthDecode);
    }
}
