//! A new scheduler written against the public API: full-depth batching that admits the
//! *shortest* waiting prompt first (the built-in CB admits in arrival order). The engine owns
//! the waiting requests and their KV blocks and lends them as `Requests`; the scheduler admits
//! from them and returns plain-data launches: `schedule`, `complete` and `finished` of
//! `LoopedScheduler`.
//!
//!     cargo run --release --example custom_scheduler

use ponder::looped::layout::KvLayout;
use ponder::looped::{LoopedLaunch, LoopedResult, LoopedRow, LoopedScheduler, Stage};
use ponder::scheduler::{Requests, SchedulerLimits};
use ponder::{EngineBuilder, GenerationParams, RequestId};

#[derive(Debug)]
struct Seq {
    id: RequestId,
    tokens: Vec<u32>,
    computed: usize,
}

/// Shortest-prompt-first admission, full depth, KV reserved for the whole request up front.
#[derive(Debug)]
pub struct ShortestPromptFirst {
    limits: SchedulerLimits,
    layout: Box<dyn KvLayout>,
    steps: usize,
    running: Vec<Seq>,
}

impl ShortestPromptFirst {
    pub fn new(limits: SchedulerLimits, layout: Box<dyn KvLayout>, steps: usize) -> Self {
        Self { limits, layout, steps, running: Vec::new() }
    }

    fn launch(&self, stage: Stage, rows: Vec<LoopedRow>) -> LoopedLaunch {
        let step_slots = (0..self.steps).map(|s| self.layout.slot_for_step(s)).collect();
        LoopedLaunch { stage, step_slots, rows, kv_copies: vec![], reenter: false }
    }

    fn row(requests: &Requests, s: &Seq) -> LoopedRow {
        LoopedRow::full_depth(s.id, s.tokens[s.computed..].to_vec(), s.computed, requests.tables(s.id).unwrap().to_vec())
    }
}

impl LoopedScheduler for ShortestPromptFirst {
    fn name(&self) -> &'static str {
        "shortest-prompt-first"
    }

    fn schedule(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        // Admit shortest prompts first while seats, token budget and worst-case KV allow.
        let mut by_length: Vec<_> = requests.waiting().map(|r| (r.prompt.len(), r.id, r.max_new_tokens)).collect();
        by_length.sort();
        let mut rows = Vec::new();
        let mut budget = self.limits.max_num_batched_tokens;
        for (len, id, max_new) in by_length {
            if self.running.len() >= self.limits.max_num_seqs || len > budget {
                break;
            }
            let Some(r) = requests.admit(id, len + max_new) else { break };
            budget -= len;
            let s = Seq { id, tokens: r.prompt, computed: 0 };
            rows.push(Self::row(requests, &s));
            self.running.push(s);
        }
        if !rows.is_empty() {
            return Some(self.launch(Stage::Prefill, rows));
        }
        let rows: Vec<LoopedRow> = self.running.iter().map(|s| Self::row(requests, s)).collect();
        (!rows.is_empty()).then(|| self.launch(Stage::FullDepthDecode, rows))
    }

    fn complete(&mut self, _requests: &mut Requests, launch: &LoopedLaunch, result: &LoopedResult) {
        for (row, out) in launch.rows.iter().zip(&result.rows) {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == row.request) {
                s.computed = row.start_pos + row.tokens.len();
                s.tokens.extend(out.token);
            }
        }
    }

    fn finished(&mut self, id: RequestId) {
        self.running.retain(|s| s.id != id);
    }
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut engine = EngineBuilder::new(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro"))
        .max_num_seqs(2)
        .looped(|o| o.custom_scheduler(|ctx| Box::new(ShortestPromptFirst::new(ctx.limits, ctx.layout, ctx.spec.max_steps))))
        .build()?;
    let prompts = ["A much longer prompt about ownership, borrowing and lifetimes", "Traits", "Closures capture"];
    for out in engine.generate(prompts, &GenerationParams::greedy(12))? {
        let out = out?;
        println!("{} (request {}): {}", engine.scheduler_name(), out.id, out.text.trim());
    }
    Ok(())
}
