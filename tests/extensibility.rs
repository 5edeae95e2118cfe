//! The extension examples (a custom exit gate, a custom scheduler), written with the public API
//! only, pass the conformance check: batched == each request alone, KV empty afterwards.

mod common;
#[path = "../examples/custom_gate.rs"]
mod custom_gate;
#[path = "../examples/custom_scheduler.rs"]
mod custom_scheduler;

use common::*;
use ponder::{KvLayoutKind, SchedulerKind};

fn check(make: &dyn Fn(usize) -> ponder::EngineBuilder) -> ponder::Engine {
    let ps = prompts(6, 21);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 3 + i).collect();
    let mut solo = make(1).build().unwrap();
    let want = sequential(&mut solo, &ps, &max_new);
    let mut engine = make(3).build().unwrap();
    assert_eq!(batched(&mut engine, &ps, &max_new), want);
    assert_kv_empty(&engine);
    engine
}

#[test]
fn custom_gate_is_batch_invariant() {
    let (_tmp, dir) = tiny_dir(51);
    let engine = check(&|w| {
        builder(&dir, KvLayoutKind::Shared, w).looped(|o| {
            o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(custom_gate::HazardThreshold { threshold: 0.5, min_steps: 1, max_steps: 4 })
        })
    });
    let d = engine.metrics().mean_depth();
    assert!(d > 1.0 && d < 4.0, "the gate exits early sometimes: mean depth {d}");
}

#[test]
fn custom_scheduler_is_batch_invariant() {
    let (_tmp, dir) = tiny_dir(52);
    let engine = check(&|w| {
        builder(&dir, KvLayoutKind::DepthIndexed, w)
            .looped(|o| o.custom_scheduler(|ctx| Box::new(custom_scheduler::ShortestPromptFirst::new(ctx.limits, ctx.kv, ctx.spec.max_steps))))
    });
    assert_eq!(engine.scheduler().name(), "shortest-prompt-first");
}

/// A gate with per-item memory in `GateState::scratch`: exit once the step's hazard stops
/// rising (scratch[0] holds the previous step's hazard).
#[derive(Debug)]
struct HazardPlateau;
impl ponder::gate::ExitGate for HazardPlateau {
    fn name(&self) -> String {
        "hazard-plateau".into()
    }
    fn min_steps(&self) -> usize {
        1
    }
    fn max_steps(&self) -> usize {
        4
    }
    fn decide(&self, _: ponder::gate::ItemRef, step: usize, signals: ponder::gate::StepSignals, state: &mut ponder::gate::GateState) -> bool {
        let hazard = signals.logit.map_or(0.0, |z| 1.0 / (1.0 + (-z).exp()));
        let plateau = step > 0 && hazard <= state.scratch[0];
        state.scratch[0] = hazard;
        step + 1 >= 4 || plateau
    }
}

#[test]
fn a_gate_with_its_own_per_item_state_is_batch_invariant() {
    let (_tmp, dir) = tiny_dir(53);
    let engine = check(&|w| builder(&dir, KvLayoutKind::LastExited, w).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(HazardPlateau)));
    let d = engine.metrics().mean_depth();
    assert!(d > 2.0 && d < 4.0, "exits after a plateau (never at step 1): mean depth {d}");
}

/// A custom gate measured by the library's benchmark harness, on the same workload and window
/// rules as the built-in modes of `bench_looped`.
#[test]
fn a_custom_gate_runs_on_the_benchmark_harness() {
    use ponder::bench::{offline, workload, Lengths, Window};
    let (_tmp, dir) = tiny_dir(54);
    let jobs = workload(12, VOCAB, 256, 7, Lengths { prompt_median: 10.0, prompt_max: 20, output_median: 12.0, output_max: 24 });
    let requested: u64 = jobs.iter().map(|j| j.new_tokens as u64).sum();
    let mut engine = builder(&dir, KvLayoutKind::LastExited, 3)
        .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(custom_gate::HazardThreshold { threshold: 0.5, min_steps: 1, max_steps: 4 }))
        .build()
        .unwrap();
    let run = offline(&mut engine, &jobs, Window { open_after: 3, completions: None, drain: true }).unwrap();
    assert_eq!(engine.metrics().generated_tokens, requested);
    assert!(run.window_tokens_per_s > 0.0 && run.mean_depth >= 1.0 && run.mean_depth <= 4.0, "{} tokens/s, depth {}", run.window_tokens_per_s, run.mean_depth);
    assert!(run.stages.get("core").is_some(), "per-stage figures: {}", run.stages);
    assert_kv_empty(&engine);
}
