//! The extension examples (a custom exit gate, a custom looped and a custom diffusion
//! scheduler), written with the public API only, pass the conformance check: batched == each
//! request alone, KV empty afterwards.

mod common;
#[path = "../examples/custom_diffusion_scheduler.rs"]
mod custom_diffusion_scheduler;
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
            o.scheduler(SchedulerKind::Depth { refill: true })
                .exit_gate(custom_gate::HazardThreshold { threshold: 0.5, bounds: ponder::looped::gate::StepBounds::new(1, 4).unwrap() })
        })
    });
    let d = engine.metrics().looped().unwrap().mean_depth();
    assert!(d > 1.0 && d < 4.0, "the gate exits early sometimes: mean depth {d}");
}

#[test]
fn custom_scheduler_is_batch_invariant() {
    let (_tmp, dir) = tiny_dir(52);
    let engine = check(&|w| {
        builder(&dir, KvLayoutKind::DepthIndexed, w)
            .looped(|o| o.custom_scheduler(|ctx| Box::new(custom_scheduler::ShortestPromptFirst::new(ctx.limits, ctx.layout, ctx.spec.max_steps))))
    });
    assert_eq!(engine.scheduler_name(), "shortest-prompt-first");
}

/// A gate with per-item memory in `GateState::scratch`: exit once the step's hazard stops
/// rising (scratch[0] holds the previous step's hazard).
#[derive(Debug)]
struct HazardPlateau;
impl ponder::looped::gate::ExitGate for HazardPlateau {
    fn name(&self) -> String {
        "hazard-plateau".into()
    }
    fn bounds(&self) -> ponder::looped::gate::StepBounds {
        ponder::looped::gate::StepBounds::new(1, 4).unwrap()
    }
    fn decide(
        &self,
        _: ponder::looped::gate::ItemRef,
        step: usize,
        signals: ponder::looped::gate::StepSignals,
        state: &mut ponder::looped::gate::GateState,
    ) -> bool {
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
    let d = engine.metrics().looped().unwrap().mean_depth();
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
        .looped(|o| {
            o.scheduler(SchedulerKind::Depth { refill: true })
                .exit_gate(custom_gate::HazardThreshold { threshold: 0.5, bounds: ponder::looped::gate::StepBounds::new(1, 4).unwrap() })
        })
        .build()
        .unwrap();
    let run = offline(&mut engine, &jobs, Window { open_after: 3, completions: None, drain: true }).unwrap();
    assert_eq!(engine.metrics().generated_tokens, requested);
    assert!(run.window_tokens_per_s > 0.0 && run.mean_depth >= 1.0 && run.mean_depth <= 4.0, "{} tokens/s, depth {}", run.window_tokens_per_s, run.mean_depth);
    assert!(run.stages.get("core").is_some(), "per-stage figures: {}", run.stages);
    assert_kv_empty(&engine);
}

/// The whole-canvas diffusion scheduler of `examples/custom_diffusion_scheduler.rs` on the three
/// diffusion families: batched == alone, KV freed. On the block-causal SDAR, recomputing the
/// whole canvas is what the built-in scheduler computes with its exact prefix cache, so with the
/// same reveal rule (two most confident per step, the rest at step four) the tokens agree.
#[test]
fn custom_diffusion_scheduler_is_batch_invariant_and_exact_on_sdar() {
    use ponder::diffusion::StaticCount;
    use ponder::testing::*;
    let tmp = tempfile::tempdir().unwrap();
    let dirs = [("sdar", tmp.path().join("sdar")), ("llada", tmp.path().join("llada")), ("dream", tmp.path().join("dream"))];
    write_random_sdar(&dirs[0].1, &tiny_sdar_config(VOCAB), 61).unwrap();
    write_random_llada(&dirs[1].1, &tiny_llada_config(VOCAB), 62).unwrap();
    write_random_dream(&dirs[2].1, &tiny_dream_config(VOCAB), 63).unwrap();
    let ps = diffusion_prompts(5, 64);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 5 + 3 * i).collect();
    let whole = |dir: &std::path::Path, width: usize| {
        ponder::EngineBuilder::new(dir)
            .block_size(4)
            .max_num_seqs(width)
            .kv_capacity_tokens(4096)
            .diffusion(|o| {
                o.block_length(8).custom_scheduler(|ctx| {
                    let (block, mask, shift) = (ctx.config.block_length, ctx.spec.mask_token_id, ctx.spec.shift_logits);
                    Box::new(custom_diffusion_scheduler::WholeCanvas::new(ctx.limits, block, 2, mask, shift))
                })
            })
            .build()
            .unwrap()
    };
    for (family, dir) in &dirs {
        let want = sequential(&mut whole(dir, 1), &ps, &max_new);
        let mut engine = whole(dir, 3);
        assert_eq!(batched(&mut engine, &ps, &max_new), want, "{family}");
        assert_kv_empty(&engine);
        assert_eq!(engine.scheduler_name(), "whole-canvas");
        if *family == "sdar" {
            let mut built_in = ponder::EngineBuilder::new(dir)
                .block_size(4)
                .max_num_seqs(3)
                .kv_capacity_tokens(4096)
                .diffusion(|o| o.block_length(8).max_steps_per_block(4).unmask_policy(StaticCount::new(2).unwrap()))
                .build()
                .unwrap();
            assert_eq!(batched(&mut built_in, &ps, &max_new), want, "whole canvas vs the exact prefix cache (SDAR)");
        }
    }
}
