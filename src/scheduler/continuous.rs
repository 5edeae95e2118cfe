//! Continuous batching at full depth: the CB baseline of the CDB paper.
//!
//! Each tick is either a prefill of newly admitted requests or one decode launch over every
//! running request, where each row runs the prelude, all r_max loop steps and the coda. When a
//! running request cannot get a KV block, the most recently admitted one is preempted: its
//! blocks are freed and it is re-prefilled (prompt + generated tokens) once there is room.
//!
//! While requests are decoding, a prefill is admitted only once `min_free_slots` resident
//! slots are free (or every waiting request fits) — the depth scheduler's rule, so both
//! baselines batch their full-depth prefills alike instead of one small prefill per finished
//! request.

use super::{LoopedLaunch, LoopedResult, LoopedRow, LoopedScheduler, Requests, SchedRequest, Scheduler, SchedulerLimits, SchedulerStats, Stage};
use crate::kv::KvManager;
use crate::request::RequestId;

#[derive(Debug)]
struct Seq {
    id: RequestId,
    /// Prompt followed by every token generated so far.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    computed: usize,
}

/// The full-depth continuous batching scheduler.
#[derive(Debug)]
pub struct ContinuousBatching {
    limits: SchedulerLimits,
    /// Waiting requests (a preempted one carries its generated tokens in its prompt).
    requests: Requests,
    max_steps: usize,
    running: Vec<Seq>,
    preemptions: u64,
    /// `None`: `max(1, max_num_seqs / 16)`, as in [`super::DepthConfig::min_free_slots`].
    min_free_slots: Option<usize>,
}

impl ContinuousBatching {
    pub fn new(limits: SchedulerLimits, kv: KvManager, max_steps: usize) -> Self {
        Self { limits, requests: Requests::new(kv), max_steps, running: Vec::new(), preemptions: 0, min_free_slots: None }
    }

    /// Admit a prefill while others decode only once this many resident slots are free (or
    /// every waiting request fits). `None`: `max(1, max_num_seqs / 16)`; `Some(1)` admits as
    /// soon as any slot frees.
    pub fn with_min_free_slots(mut self, n: Option<usize>) -> Self {
        self.min_free_slots = n;
        self
    }

    fn step_slots(&self) -> Vec<usize> {
        (0..self.max_steps).map(|s| self.requests.kv().layout().slot_for_step(s)).collect()
    }

    fn row(&self, seq: &Seq) -> LoopedRow {
        LoopedRow::full_depth(seq.id, seq.tokens[seq.computed..].to_vec(), seq.computed, self.requests.kv().tables(seq.id).expect("reserved").to_vec())
    }

    fn schedule_prefill(&mut self) -> Option<LoopedLaunch> {
        let free = self.limits.max_num_seqs.saturating_sub(self.running.len());
        if !self.limits.admits_prefill(self.min_free_slots, !self.running.is_empty(), free, self.requests.num_waiting()) {
            return None;
        }
        let mut rows = Vec::new();
        let mut budget = self.limits.max_num_batched_tokens;
        while self.running.len() < self.limits.max_num_seqs {
            let Some(next) = self.requests.front() else {
                break;
            };
            let len = next.prompt.len();
            if len > budget {
                break;
            }
            // Leave every running request room to grow by one block per slot, so admitting
            // this one does not force a preemption on the very next decode.
            let kv = self.requests.kv();
            let headroom = self.running.len() * kv.num_slots();
            if kv.blocks_missing(next.id, len) + headroom > kv.num_free_blocks() {
                break;
            }
            let next = self.requests.admit_front(len).expect("checked free blocks");
            let seq = Seq { id: next.id, tokens: next.prompt, computed: 0 };
            budget -= len;
            rows.push(self.row(&seq));
            self.running.push(seq);
        }
        (!rows.is_empty()).then(|| LoopedLaunch { stage: Stage::Prefill, step_slots: self.step_slots(), rows, kv_copies: vec![], reenter: false })
    }

    fn schedule_decode(&mut self) -> Option<LoopedLaunch> {
        let mut i = 0;
        while i < self.running.len() {
            let (id, need) = (self.running[i].id, self.running[i].tokens.len());
            if self.requests.kv_mut().reserve(id, need) {
                i += 1;
                continue;
            }
            // Preempt the most recently admitted request (possibly this one) and retry.
            let victim = self.running.pop().expect("non-empty");
            self.requests.kv_mut().free(victim.id);
            self.preemptions += 1;
            let victim_was_current = i == self.running.len();
            // Re-prefilled later with what it generated so far (recompute preemption).
            self.requests.push_front(SchedRequest { id: victim.id, prompt: victim.tokens, max_new_tokens: 0 });
            if victim_was_current {
                break;
            }
        }
        if self.running.is_empty() {
            return None;
        }
        let rows = self.running.iter().map(|s| self.row(s)).collect();
        Some(LoopedLaunch { stage: Stage::FullDepthDecode, step_slots: self.step_slots(), rows, kv_copies: vec![], reenter: false })
    }
}

impl Scheduler for ContinuousBatching {
    fn name(&self) -> &'static str {
        "cb"
    }

    fn add(&mut self, request: SchedRequest) {
        self.requests.push(request);
    }

    fn finish(&mut self, id: RequestId) {
        self.running.retain(|s| s.id != id);
        self.requests.forget(id);
    }

    fn num_waiting(&self) -> usize {
        self.requests.num_waiting()
    }
    fn num_running(&self) -> usize {
        self.running.len()
    }
    fn kv(&self) -> &KvManager {
        self.requests.kv()
    }
    fn stats(&self) -> SchedulerStats {
        SchedulerStats { preemptions: self.preemptions, ..SchedulerStats::default() }
    }
}

impl LoopedScheduler for ContinuousBatching {
    fn schedule(&mut self) -> Option<LoopedLaunch> {
        if let Some(l) = self.schedule_prefill() {
            return Some(l);
        }
        self.schedule_decode().or_else(|| self.schedule_prefill())
    }

    fn complete(&mut self, launch: &LoopedLaunch, result: &LoopedResult) {
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
    use crate::kv::{DepthIndexed, Shared};
    use crate::scheduler::LoopedRowOutput;

    fn req(id: u64, len: usize) -> SchedRequest {
        SchedRequest { id: RequestId(id), prompt: (0..len as u32).collect(), max_new_tokens: 8 }
    }

    fn answer(l: &LoopedLaunch, token: u32) -> LoopedResult {
        LoopedResult { rows: l.rows.iter().map(|r| LoopedRowOutput { token: Some(token), ..LoopedRowOutput::new(r.request) }).collect() }
    }

    #[test]
    fn prefill_then_full_depth_decode() {
        let limits = SchedulerLimits { max_num_seqs: 2, max_num_batched_tokens: 64 };
        let mut s = ContinuousBatching::new(limits, KvManager::new(64, 4, Box::new(DepthIndexed), 4), 4);
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
        let mut s = ContinuousBatching::new(limits, KvManager::new(64, 4, Box::new(Shared), 4), 4).with_min_free_slots(Some(2));
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
        // With one request left waiting, one free slot is enough.
        s.finish(RequestId(2));
        let l = s.schedule().unwrap();
        assert_eq!((l.stage, l.rows.len()), (Stage::Prefill, 1));
    }

    #[test]
    fn preempts_youngest_when_blocks_run_out() {
        let limits = SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 64 };
        let mut s = ContinuousBatching::new(limits, KvManager::new(5, 4, Box::new(Shared), 4), 4);
        s.add(req(0, 7));
        s.add(req(1, 6));
        let l = s.schedule().unwrap();
        assert_eq!(l.rows.len(), 2);
        s.complete(&l, &answer(&l, 1));
        let mut generated_1 = 1;
        loop {
            let l = s.schedule().unwrap();
            assert_eq!(l.stage, Stage::FullDepthDecode);
            if s.stats().preemptions == 1 {
                assert_eq!(l.rows.len(), 1);
                assert_eq!(l.rows[0].request, RequestId(0));
                break;
            }
            generated_1 += 1;
            s.complete(&l, &answer(&l, 2));
        }
        assert_eq!(s.num_waiting(), 1);
        s.finish(RequestId(0));
        let l = s.schedule().unwrap();
        assert_eq!(l.stage, Stage::Prefill);
        assert_eq!(l.rows[0].tokens.len(), 6 + generated_1, "recompute re-prefills prompt + generated");
        s.finish(RequestId(1));
        assert_eq!(s.kv().num_used_blocks(), 0);
    }
}
