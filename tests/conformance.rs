//! Batching never changes results: for every scheduler × layout, batched greedy output equals
//! each request run alone (token-exact, f32, CPU), including requests that arrive and abort
//! mid-generation and requests preempted for lack of KV blocks.

mod common;
use common::*;
use ponder::{GenerationParams, KvLayoutKind, TokenCompute};
use std::collections::HashMap;

const LAYOUTS: [KvLayoutKind; 2] = [KvLayoutKind::DepthIndexed, KvLayoutKind::Shared];

#[test]
fn batched_equals_sequential() {
    let (_tmp, dir) = tiny_dir(1);
    let ps = prompts(9, 3);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 3 + (i * 5) % 11).collect();
    let mut per_layout = Vec::new();
    for layout in LAYOUTS {
        let mut solo = builder(&dir, layout, 1).build().unwrap();
        let want = sequential(&mut solo, &ps, &max_new);
        assert_kv_empty(&solo);
        // The test model must not be degenerate: outputs vary across requests and tokens.
        assert!(want.windows(2).any(|w| w[0] != w[1]));
        assert!(want.iter().any(|t| t.iter().any(|&x| x != t[0])));
        per_layout.push(want.clone());

        let mut engine = builder(&dir, layout, 4).build().unwrap();
        assert_eq!(batched(&mut engine, &ps, &max_new), want, "{layout:?}");
        assert_kv_empty(&engine);
    }
    // Shared KV reads earlier tokens' last-step K/V instead of the same step's: a different
    // function, so the layouts must disagree somewhere (proof that the slot mapping is live).
    assert_ne!(per_layout[0], per_layout[1]);
}

#[test]
fn arrivals_and_aborts_mid_generation() {
    let (_tmp, dir) = tiny_dir(2);
    let ps = prompts(8, 11);
    let max_new = vec![12; ps.len()];
    for layout in LAYOUTS {
        let mut solo = builder(&dir, layout, 1).build().unwrap();
        let want = sequential(&mut solo, &ps, &max_new);

        let mut engine = builder(&dir, layout, 3).build().unwrap();
        let mut ids = Vec::new();
        let mut got = HashMap::new();
        let mut aborted = Vec::new();
        let mut step = 0;
        while ids.len() < ps.len() || engine.has_work() {
            // A new request every other step; abort request 2 and 5 a few steps after they start.
            if step % 2 == 0 && ids.len() < ps.len() {
                let i = ids.len();
                ids.push(engine.add_request(ps[i].clone(), GenerationParams::greedy(max_new[i])).unwrap());
            }
            for victim in [2usize, 5] {
                if ids.len() > victim && step == 2 * victim + 4 && engine.abort(ids[victim]).is_ok() {
                    aborted.push(ids[victim]);
                }
            }
            for ev in engine.step().unwrap() {
                if let ponder::Event::Token { id, token, .. } = ev {
                    got.entry(id).or_insert_with(Vec::new).push(token);
                }
            }
            step += 1;
        }
        assert_eq!(aborted.len(), 2, "{layout:?}: both aborts landed mid-generation");
        for (i, id) in ids.iter().enumerate() {
            let g = got.get(id).cloned().unwrap_or_default();
            if aborted.contains(id) {
                assert!(g.len() < max_new[i] && want[i].starts_with(&g), "{layout:?} aborted request {i} is a prefix");
            } else {
                assert_eq!(g, want[i], "{layout:?} request {i}");
            }
        }
        assert_kv_empty(&engine);
    }
}

#[test]
fn preemption_under_kv_pressure_keeps_outputs() {
    let (_tmp, dir) = tiny_dir(3);
    let ps = prompts(6, 5);
    let max_new = vec![16; ps.len()];
    // Every layout: a slot per step (depth-indexed, last-exited) recomputes in one prefill; shared
    // slots (shared, first-then-shared) replay the generated tokens.
    for layout in [KvLayoutKind::DepthIndexed, KvLayoutKind::LastExited, KvLayoutKind::Shared, KvLayoutKind::FirstThenShared] {
        let mut solo = builder(&dir, layout, 1).build().unwrap();
        let want = sequential(&mut solo, &ps, &max_new);
        // Room for about two requests at a time in every slot.
        let slots = match layout {
            KvLayoutKind::DepthIndexed | KvLayoutKind::LastExited => 4,
            KvLayoutKind::FirstThenShared => 2,
            _ => 1,
        };
        let mut engine = builder(&dir, layout, 6).kv_capacity_tokens(72 * slots).build().unwrap();
        let got = batched(&mut engine, &ps, &max_new);
        for i in 0..ps.len() {
            assert_eq!(got[i], want[i], "{layout:?} request {i}");
        }
        assert!(engine.metrics().preemptions > 0, "{layout:?}: the pool was meant to run out");
        assert_kv_empty(&engine);
    }
}

#[test]
fn seeded_sampling_is_batch_invariant() {
    let (_tmp, dir) = tiny_dir(4);
    let ps = prompts(4, 9);
    let params = |seed| GenerationParams {
        max_new_tokens: 10,
        sampling: ponder::SamplingParams { temperature: 0.9, top_k: Some(20), top_p: Some(0.95), seed: Some(seed) },
        ..Default::default()
    };
    let mut solo = builder(&dir, KvLayoutKind::Shared, 1).build().unwrap();
    let want: Vec<_> = ps.iter().enumerate().map(|(i, p)| solo.generate([p.clone()], &params(i as u64)).unwrap().remove(0).unwrap().token_ids).collect();
    let mut engine = builder(&dir, KvLayoutKind::Shared, 4).build().unwrap();
    let ids: Vec<_> = ps.iter().enumerate().map(|(i, p)| engine.add_request(p.clone(), params(i as u64)).unwrap()).collect();
    let mut got = HashMap::new();
    drain(&mut engine, &mut got);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(got[id], want[i], "request {i}");
    }
    // Different seeds give different samples (the draw is really random).
    assert!(want.windows(2).any(|w| w[0] != w[1]));
}

/// Every token event feeds the latency metrics: one time-to-first-token per request, one
/// inter-token gap per later token, quantiles ordered, for a looped and a diffusion model.
#[test]
fn latency_metrics_count_every_token() {
    let check = |m: &ponder::EngineMetrics, requests: u64| {
        assert_eq!(m.time_to_first_token.count(), requests);
        assert_eq!(m.inter_token_latency.count(), m.generated_tokens - requests);
        let (p50, p90, p99) = m.time_to_first_token.p50_p90_p99().unwrap();
        assert!(p50 <= p90 && p90 <= p99 && p99 <= m.time_to_first_token.max().unwrap());
    };
    let (_tmp, dir) = tiny_dir(9);
    let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 3).build().unwrap();
    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(6) };
    let outs = engine.generate(prompts(5, 4), &params).unwrap();
    assert!(outs.iter().all(|o| o.as_ref().unwrap().token_ids.len() == 6));
    check(engine.metrics(), 5);
    let tmp = tempfile::tempdir().unwrap();
    let sdar = tmp.path().join("sdar");
    ponder::testing::write_random_sdar(&sdar, &ponder::testing::tiny_sdar_config(VOCAB), 4).unwrap();
    let mut engine = ponder::EngineBuilder::new(&sdar).block_size(4).kv_capacity_tokens(4096).diffusion(|o| o.block_length(8)).build().unwrap();
    engine.generate(diffusion_prompts(3, 5), &params).unwrap();
    check(engine.metrics(), 3);
}

/// Token events say the compute each token took: full depth under CB; under depth batching
/// exactly the steps the depth histogram counts; for block diffusion the denoising step of the
/// block that revealed the token.
#[test]
fn token_events_say_the_compute_each_token_took() {
    use ponder::looped::gate::{DepthTrace, Replay};
    use ponder::{Event, SchedulerKind};
    let steps_of = |engine: &mut ponder::Engine, prompts: Vec<Vec<u32>>| {
        let looped = engine.spec().looped().is_some();
        let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(7) };
        for p in prompts {
            engine.add_request(p, params.clone()).unwrap();
        }
        let mut steps = Vec::new();
        while engine.has_work() {
            for ev in engine.step().unwrap() {
                if let Event::Token { compute, .. } = ev {
                    // Each family reports the compute in its own terms.
                    steps.push(match (compute.expect("every built-in scheduler says"), looped) {
                        (TokenCompute::LoopSteps(n), true) | (TokenCompute::DenoiseStep(n), false) => n,
                        (other, _) => panic!("a {} engine reported {other:?}", if looped { "looped" } else { "diffusion" }),
                    });
                }
            }
        }
        steps
    };
    let (_tmp, dir) = tiny_dir(12);
    let mut cb = builder(&dir, KvLayoutKind::DepthIndexed, 3).build().unwrap();
    assert!(steps_of(&mut cb, prompts(4, 6)).iter().all(|&s| s == 4));
    let gate = Replay::new(DepthTrace::with_mean(2.5, 1, 4, 3).unwrap(), 1, 4).unwrap();
    let mut depth = builder(&dir, KvLayoutKind::LastExited, 3).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(gate)).build().unwrap();
    let steps = steps_of(&mut depth, prompts(4, 6));
    let mut per_depth = vec![0u64; 4];
    for s in &steps {
        per_depth[*s as usize - 1] += 1;
    }
    assert_eq!(per_depth, depth.metrics().looped().unwrap().depth_histogram, "events and the histogram agree");
    assert!(per_depth[..3].iter().sum::<u64>() > 0, "some tokens exited early");
    let tmp = tempfile::tempdir().unwrap();
    let sdar = tmp.path().join("sdar");
    ponder::testing::write_random_sdar(&sdar, &ponder::testing::tiny_sdar_config(VOCAB), 6).unwrap();
    let mut diffusion = ponder::EngineBuilder::new(&sdar)
        .block_size(4)
        .kv_capacity_tokens(4096)
        .diffusion(|o| o.block_length(8).unmask_policy(ponder::diffusion::StaticCount::new(2).unwrap()))
        .build()
        .unwrap();
    let steps = steps_of(&mut diffusion, diffusion_prompts(3, 7));
    assert!(steps.iter().all(|&s| (1..=4).contains(&s)), "two reveals a step: a block of 8 ends by step 4: {steps:?}");
    assert!(steps.contains(&1) && steps.iter().any(|&s| s > 1));
}

/// Log-probabilities asked with a request: the tokens are the ones generated without asking;
/// each token's log-probability is the one teacher forcing reports for it, greedy tokens head
/// their alternatives, the alternatives are ordered and as many as asked; batched equals alone;
/// too many alternatives and diffusion models are typed refusals.
#[test]
fn logprobs_are_the_models_and_batch_invariant() {
    let (_tmp, dir) = tiny_dir(5);
    let ps = prompts(4, 7);
    let with = |sampled: bool, seed: u64, logprobs: Option<usize>| GenerationParams {
        max_new_tokens: 8,
        sampling: if sampled { ponder::SamplingParams { temperature: 1.0, top_k: None, top_p: Some(0.9), seed: Some(seed) } } else { Default::default() },
        logprobs,
        ..Default::default()
    };
    for layout in LAYOUTS {
        let mut solo = builder(&dir, layout, 1).build().unwrap();
        let mut alone = Vec::new();
        for (i, p) in ps.iter().enumerate() {
            let sampled = i % 2 == 1;
            let plain = solo.generate([p.clone()], &with(sampled, i as u64, None)).unwrap().remove(0).unwrap();
            assert!(plain.logprobs.is_empty());
            let out = solo.generate([p.clone()], &with(sampled, i as u64, Some(3))).unwrap().remove(0).unwrap();
            assert_eq!(out.token_ids, plain.token_ids, "{layout:?} request {i}: asking changed the tokens");
            assert_eq!((out.logprobs.len(), out.top_logprobs.len()), (8, 8));
            let forced = GenerationParams { forced_tokens: out.token_ids.clone(), ..GenerationParams::greedy(8) };
            let scored = solo.generate([p.clone()], &forced).unwrap().remove(0).unwrap();
            for (t, ((lp, top), want)) in out.logprobs.iter().zip(&out.top_logprobs).zip(&scored.logprobs).enumerate() {
                assert!((lp - want).abs() < 1e-5, "{layout:?} request {i} token {t}: {lp} vs forced {want}");
                assert_eq!(top.len(), 3);
                assert!(top.windows(2).all(|w| w[0].1 >= w[1].1) && *lp <= top[0].1 + 1e-6);
                if !sampled {
                    assert_eq!(top[0], (out.token_ids[t], *lp), "{layout:?} request {i} token {t}: a greedy token heads its alternatives");
                }
            }
            alone.push((out.token_ids, out.logprobs, out.top_logprobs));
        }
        let mut engine = builder(&dir, layout, 4).build().unwrap();
        let ids: Vec<_> = ps.iter().enumerate().map(|(i, p)| engine.add_request(p.clone(), with(i % 2 == 1, i as u64, Some(3))).unwrap()).collect();
        let mut outs: HashMap<_, ponder::Output> = ids.iter().map(|&id| (id, ponder::Output::new(id, 0))).collect();
        while engine.has_work() {
            for ev in engine.step().unwrap() {
                outs.get_mut(&ev.id()).unwrap().push(ev);
            }
        }
        for (i, id) in ids.iter().enumerate() {
            let o = &outs[id];
            // Tokens and alternatives exactly; values to the last bits a launch of other rows
            // may move an f32 matmul by.
            assert_eq!(o.token_ids, alone[i].0, "{layout:?} request {i} batched");
            let close = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
            assert!(close(&o.logprobs, &alone[i].1), "{layout:?} request {i} batched: {:?} vs {:?}", o.logprobs, alone[i].1);
            for (got, want) in o.top_logprobs.iter().zip(&alone[i].2) {
                let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
                let values = |v: &[(u32, f32)]| v.iter().map(|x| x.1).collect::<Vec<_>>();
                assert!(ids(got) == ids(want) && close(&values(got), &values(want)), "{layout:?} request {i} batched: {got:?} vs {want:?}");
            }
        }
        assert_kv_empty(&engine);
        let too_many = engine.add_request(ps[0].clone(), with(false, 0, Some(ponder::MAX_TOP_LOGPROBS + 1)));
        assert!(matches!(too_many, Err(ponder::Error::InvalidRequest { .. })), "{too_many:?}");
    }
    let diffusion = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-sdar");
    let mut sdar = ponder::EngineBuilder::new(diffusion).build().unwrap();
    assert!(matches!(sdar.add_request(vec![1, 2, 3], with(false, 0, Some(0))), Err(ponder::Error::InvalidRequest { .. })));
}
