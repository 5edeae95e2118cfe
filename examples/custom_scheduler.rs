//! A new scheduler written against the public API: full-depth batching that admits the
//! *shortest* waiting prompt first (the built-in CB admits in arrival order). It owns its KV
//! bookkeeping through `KvManager` and returns plain-data launches, like every scheduler: six
//! methods of the common `Scheduler` part and `schedule` / `complete` of `LoopedScheduler`.
//!
//!     cargo run --release --example custom_scheduler

use ponder::kv::KvManager;
use ponder::looped::layout::KvLayout;
use ponder::looped::{LoopedLaunch, LoopedResult, LoopedRow, LoopedScheduler, Stage};
use ponder::scheduler::{SchedRequest, Scheduler, SchedulerLimits};
use ponder::{EngineBuilder, GenerationParams, RequestId};

#[derive(Debug)]
struct Seq {
    id: RequestId,
    tokens: Vec<u32>,
    computed: usize,
    max_new: usize,
}

/// Shortest-prompt-first admission, full depth, KV reserved for the whole request up front.
#[derive(Debug)]
pub struct ShortestPromptFirst {
    limits: SchedulerLimits,
    kv: KvManager,
    layout: Box<dyn KvLayout>,
    steps: usize,
    waiting: Vec<Seq>,
    running: Vec<Seq>,
}

impl ShortestPromptFirst {
    pub fn new(limits: SchedulerLimits, kv: KvManager, layout: Box<dyn KvLayout>, steps: usize) -> Self {
        Self { limits, kv, layout, steps, waiting: Vec::new(), running: Vec::new() }
    }

    fn launch(&self, stage: Stage, rows: Vec<LoopedRow>) -> LoopedLaunch {
        let step_slots = (0..self.steps).map(|s| self.layout.slot_for_step(s)).collect();
        LoopedLaunch { stage, step_slots, rows, kv_copies: vec![], reenter: false }
    }

    fn row(&self, s: &Seq) -> LoopedRow {
        LoopedRow::full_depth(s.id, s.tokens[s.computed..].to_vec(), s.computed, self.kv.tables(s.id).unwrap().to_vec())
    }
}

impl Scheduler for ShortestPromptFirst {
    fn name(&self) -> &'static str {
        "shortest-prompt-first"
    }
    fn add(&mut self, r: SchedRequest) {
        self.waiting.push(Seq { id: r.id, tokens: r.prompt, computed: 0, max_new: r.max_new_tokens });
    }
    fn finish(&mut self, id: RequestId) {
        self.waiting.retain(|s| s.id != id);
        self.running.retain(|s| s.id != id);
        self.kv.free(id);
    }
    fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    fn num_running(&self) -> usize {
        self.running.len()
    }
    fn kv(&self) -> &KvManager {
        &self.kv
    }
}

impl LoopedScheduler for ShortestPromptFirst {
    fn schedule(&mut self) -> Option<LoopedLaunch> {
        // Admit shortest prompts first while seats, token budget and worst-case KV allow.
        self.waiting.sort_by_key(|s| (s.tokens.len(), s.id));
        let mut rows = Vec::new();
        let mut budget = self.limits.max_num_batched_tokens;
        while self.running.len() < self.limits.max_num_seqs && !self.waiting.is_empty() {
            let s = &self.waiting[0];
            if s.tokens.len() > budget || !self.kv.reserve(s.id, s.tokens.len() + s.max_new) {
                break;
            }
            let s = self.waiting.remove(0);
            budget -= s.tokens.len();
            rows.push(self.row(&s));
            self.running.push(s);
        }
        if !rows.is_empty() {
            return Some(self.launch(Stage::Prefill, rows));
        }
        if self.running.is_empty() {
            return None;
        }
        let rows = self.running.iter().map(|s| self.row(s)).collect();
        Some(self.launch(Stage::FullDepthDecode, rows))
    }
    fn complete(&mut self, launch: &LoopedLaunch, result: &LoopedResult) {
        for (row, out) in launch.rows.iter().zip(&result.rows) {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == row.request) {
                s.computed = row.start_pos + row.tokens.len();
                s.tokens.extend(out.token);
            }
        }
    }
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut engine = EngineBuilder::new(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro"))
        .max_num_seqs(2)
        .looped(|o| o.custom_scheduler(|ctx| Box::new(ShortestPromptFirst::new(ctx.limits, ctx.kv, ctx.layout, ctx.spec.max_steps))))
        .build()?;
    let prompts = ["A much longer prompt about ownership, borrowing and lifetimes", "Traits", "Closures capture"];
    for out in engine.generate(prompts, &GenerationParams::greedy(12))? {
        let out = out?;
        println!("{} (request {}): {}", engine.scheduler().name(), out.id, out.text.trim());
    }
    Ok(())
}
