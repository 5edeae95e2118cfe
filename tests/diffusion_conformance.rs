//! Block diffusion through the public engine on tiny random SDAR, LLaDA and Dream checkpoints:
//! for every unmask policy, with and without the delayed cache, batched greedy output equals
//! each request run alone (token-exact, f32, CPU), and the KV pool is empty afterwards; so does
//! sampled output, for a given seed.

use ponder::diffusion::{CanvasCache, Replay, StaticCount, Threshold, UnmaskPolicy, UnmaskTrace};
use ponder::testing::{
    tiny_dream_config, tiny_llada2_config, tiny_llada_config, tiny_sdar_config, tiny_sdar_moe_config, write_random_dream, write_random_llada,
    write_random_llada2, write_random_sdar,
};
use ponder::{Engine, EngineBuilder, Event, GenerationParams, RequestId};
mod common;
use common::{assert_kv_empty, diffusion_prompts, VOCAB};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn family_dirs(tmp: &Path) -> Vec<(&'static str, PathBuf)> {
    let sdar = tmp.join("sdar");
    write_random_sdar(&sdar, &tiny_sdar_config(VOCAB), 5).unwrap();
    let llada = tmp.join("llada");
    write_random_llada(&llada, &tiny_llada_config(VOCAB), 6).unwrap();
    let dream = tmp.join("dream");
    write_random_dream(&dream, &tiny_dream_config(VOCAB), 7).unwrap();
    let llada2 = tmp.join("llada2");
    write_random_llada2(&llada2, &tiny_llada2_config(VOCAB), 8).unwrap();
    let sdar_moe = tmp.join("sdar_moe");
    write_random_sdar(&sdar_moe, &tiny_sdar_moe_config(VOCAB), 9).unwrap();
    vec![("sdar", sdar), ("llada", llada), ("dream", dream), ("llada2", llada2), ("sdar_moe", sdar_moe)]
}

fn policies() -> Vec<(&'static str, Box<dyn UnmaskPolicy>)> {
    vec![
        ("threshold", Box::new(Threshold::new(0.6).unwrap())),
        ("static", Box::new(StaticCount::new(3).unwrap())),
        ("replay", Box::new(Replay::new(UnmaskTrace::with_mean(2.5, 8, 11).unwrap()))),
    ]
}

/// What a step recomputes: the block-causal SDAR (dense and MoE) and LLaDA2.0 with or without
/// the delayed cache; LLaDA / Dream exact, with
/// the prefix cache (with and without the delayed cache) or the dual cache.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Sdar { delayed: bool },
    Canvas { cache: CanvasCache, delayed: bool },
}

fn modes(family: &str) -> Vec<Mode> {
    if matches!(family, "sdar" | "llada2" | "sdar_moe") {
        return vec![Mode::Sdar { delayed: false }, Mode::Sdar { delayed: true }];
    }
    [(CanvasCache::Exact, false), (CanvasCache::Prefix, false), (CanvasCache::Prefix, true), (CanvasCache::Dual, false)]
        .into_iter()
        .map(|(cache, delayed)| Mode::Canvas { cache, delayed })
        .collect()
}

fn engine(dir: &Path, policy: Box<dyn UnmaskPolicy>, mode: Mode, width: usize) -> Engine {
    let b = EngineBuilder::new(dir).block_size(4).diffusion(|o| o.block_length(8)).max_num_seqs(width).max_num_batched_tokens(256).kv_capacity_tokens(2048);
    match mode {
        Mode::Sdar { delayed } => b.diffusion(|o| o.delayed_cache(delayed).unmask_policy_boxed(policy)),
        Mode::Canvas { cache, delayed } => b.diffusion(|o| o.canvas_cache(cache).delayed_cache(delayed).unmask_policy_boxed(policy)),
    }
    .build()
    .unwrap()
}

fn drain(engine: &mut Engine, out: &mut HashMap<RequestId, Vec<u32>>, events: &mut usize) {
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let Event::Token { id, token, .. } = ev {
                out.entry(id).or_default().push(token);
                *events += 1;
            }
        }
    }
}

#[test]
fn batched_equals_sequential_for_every_family_policy_and_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let ps = diffusion_prompts(6, 3);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 5 + (i * 7) % 13).collect();
    let mut outputs = HashMap::new();
    let mut per_step = HashMap::new();
    for (family, dir) in family_dirs(tmp.path()) {
        for mode in modes(family) {
            for ((name, p_seq), (_, p_bat)) in policies().into_iter().zip(policies()) {
                let label = format!("{family} × {name} × {mode:?}");
                let mut solo = engine(&dir, p_seq, mode, 1);
                let want: Vec<Vec<u32>> = ps
                    .iter()
                    .zip(&max_new)
                    .map(|(p, &n)| solo.generate([p.clone()], &GenerationParams::greedy(n)).unwrap().remove(0).unwrap().token_ids)
                    .collect();
                assert_kv_empty(&solo);
                let mut batched = engine(&dir, p_bat, mode, 4);
                let ids: Vec<RequestId> = ps.iter().zip(&max_new).map(|(p, &n)| batched.add_request(p.clone(), GenerationParams::greedy(n)).unwrap()).collect();
                let (mut got, mut events) = (HashMap::new(), 0);
                drain(&mut batched, &mut got, &mut events);
                for (i, id) in ids.iter().enumerate() {
                    assert_eq!(got.get(id).cloned().unwrap_or_default(), want[i], "{label}: request {i}");
                    assert_eq!(want[i].len(), max_new[i], "{label}: request {i} length");
                }
                assert_kv_empty(&batched);
                let m = batched.metrics();
                assert!(
                    m.denoise().unwrap().steps > 0 && (m.generated_tokens as f64 / m.denoise().unwrap().steps.max(1) as f64) > 0.5,
                    "{label}: {:?}",
                    m.denoise().unwrap()
                );
                let distinct: std::collections::HashSet<u32> = want.iter().flatten().copied().collect();
                assert!(distinct.len() >= 4, "{label}: degenerate output {want:?}");
                per_step.insert(label.clone(), m.denoise().unwrap().tokens_per_step());
                outputs.insert(label, want);
            }
        }
    }
    // Each cache recomputes fewer positions per step than the mode before it.
    for name in ["threshold", "static", "replay"] {
        let at = |family: &str, mode: Mode| per_step[&format!("{family} × {name} × {mode:?}")];
        assert!(at("sdar", Mode::Sdar { delayed: true }) < at("sdar", Mode::Sdar { delayed: false }), "sdar × {name}");
        for family in ["llada", "dream"] {
            let canvas = |cache, delayed| at(family, Mode::Canvas { cache, delayed });
            let chain =
                [canvas(CanvasCache::Exact, false), canvas(CanvasCache::Prefix, false), canvas(CanvasCache::Prefix, true), canvas(CanvasCache::Dual, false)];
            assert!(chain[0] > chain[1] && chain[1] > chain[2] && chain[1] > chain[3], "{family} × {name}: tokens per step {chain:?}");
        }
    }
    // The policies are not no-ops: they decode differently.
    let a = &outputs["sdar × threshold × Sdar { delayed: false }"];
    let b = &outputs["sdar × static × Sdar { delayed: false }"];
    assert_ne!(a, b);
    // The caches are approximations for bidirectional models: somewhere they decode differently.
    let exact = |f: &str| &outputs[&format!("{f} × static × {:?}", Mode::Canvas { cache: CanvasCache::Exact, delayed: false })];
    let dual = |f: &str| &outputs[&format!("{f} × static × {:?}", Mode::Canvas { cache: CanvasCache::Dual, delayed: false })];
    assert!(exact("llada") != dual("llada") || exact("dream") != dual("dream"), "the dual cache changed nothing");
}

#[test]
fn tokens_stream_before_their_block_completes() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, dir) = family_dirs(tmp.path()).remove(0);
    // One token per step, left to right or not: a block of 8 takes 8 steps, tokens arrive over
    // several steps rather than all at the block's end.
    let mut e = engine(&dir, Box::new(StaticCount::new(1).unwrap()), Mode::Sdar { delayed: false }, 2);
    let id = e.add_request(vec![3, 4, 5, 6, 7, 8, 9, 10], GenerationParams::greedy(8)).unwrap();
    let mut steps_with_tokens = 0;
    while e.has_work() {
        let evs = e.step().unwrap();
        if evs.iter().any(|ev| matches!(ev, Event::Token { id: i, .. } if *i == id)) {
            steps_with_tokens += 1;
        }
    }
    assert!(steps_with_tokens >= 2, "tokens came in {steps_with_tokens} step(s)");
}

#[test]
fn abort_mid_block_frees_kv_and_others_finish() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, dir) = family_dirs(tmp.path()).remove(0);
    let mut e = engine(&dir, Box::new(StaticCount::new(1).unwrap()), Mode::Sdar { delayed: true }, 4);
    let a = e.add_request(vec![1, 2, 3], GenerationParams::greedy(12)).unwrap();
    let b = e.add_request(vec![4, 5, 6, 7, 8, 9, 10, 11, 12], GenerationParams::greedy(12)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    e.abort(a).unwrap();
    let mut finished = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Finished { id, reason, .. } = ev {
                finished.insert(id, reason);
            }
        }
    }
    assert_eq!(finished[&a], ponder::FinishReason::Aborted);
    assert_eq!(finished[&b], ponder::FinishReason::Length);
    assert_kv_empty(&e);
}

#[test]
fn bad_inputs_get_typed_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = family_dirs(tmp.path());
    let dir = &dirs[0].1;
    let mut e = engine(dir, Box::new(StaticCount::new(2).unwrap()), Mode::Sdar { delayed: false }, 2);
    let rejected = |r: ponder::Result<RequestId>| matches!(r, Err(ponder::Error::InvalidRequest { .. }));
    assert!(rejected(e.add_request(Vec::<u32>::new(), GenerationParams::greedy(4))));
    assert!(rejected(e.add_request(vec![VOCAB as u32 + 5], GenerationParams::greedy(4))));
    // Context 512: prompt + new tokens rounded up to whole blocks must fit.
    assert!(rejected(e.add_request(vec![1; 505], GenerationParams::greedy(10))));
    let mut sampled = GenerationParams::greedy(4);
    sampled.sampling.top_p = Some(0.0);
    sampled.sampling.temperature = 0.8;
    assert!(rejected(e.add_request(vec![1, 2], sampled)));
    // The engine still serves a good request afterwards.
    let out = e.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(5)).unwrap().remove(0).unwrap();
    assert_eq!(out.token_ids.len(), 5);
    assert_kv_empty(&e);

    // A block length that does not divide the context window (512).
    let err = EngineBuilder::new(dir).diffusion(|o| o.block_length(24)).build();
    assert!(matches!(err, Err(ponder::Error::InvalidOption(_))), "{:?}", err.err());
    // Options that belong to looped models: one typed error, before any weight is read.
    let wrong = |r: ponder::Result<ponder::Engine>| matches!(r, Err(ponder::Error::WrongFamily { options: "looped", family: "diffusion", .. }));
    assert!(wrong(EngineBuilder::new(dir).looped(|o| o.kv_layout(ponder::KvLayoutKind::LastExited)).build()));
    assert!(wrong(EngineBuilder::new(dir).looped(|o| o.min_coda_batch_size(2)).build()));
    assert!(wrong(EngineBuilder::new(dir).looped(|o| o.coda_reserve(1)).build()));
    // Also when the model's own family's options are given too: nothing is silently ignored.
    assert!(wrong(EngineBuilder::new(dir).looped(|o| o.coda_reserve(1)).diffusion(|o| o.block_length(8)).build()));
    // A checkpoint whose mask id is missing from the vocabulary.
    let mut cfg = tiny_sdar_config(VOCAB);
    cfg.mask_token_id = None; // the family default (151669) is outside a 97-token vocabulary
    let bad = tmp.path().join("no-mask");
    write_random_sdar(&bad, &cfg, 1).unwrap_or(());
    std::fs::write(bad.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    assert!(matches!(EngineBuilder::new(&bad).build(), Err(ponder::Error::BadConfig { .. })));
}

#[test]
fn kv_exhaustion_queues_then_admits() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, dir) = family_dirs(tmp.path()).remove(0);
    // 64 positions: each request needs 24 (prompt 5 + 14 new → 3 blocks of 8), so two fit.
    let mut e = EngineBuilder::new(&dir)
        .block_size(4)
        .diffusion(|o| o.block_length(8))
        .max_num_seqs(8)
        .kv_capacity_tokens(64)
        .diffusion(|o| o.unmask_policy(StaticCount::new(2).unwrap()))
        .build()
        .unwrap();
    let ps = diffusion_prompts(5, 9).into_iter().map(|mut p| {
        p.resize(5, 1);
        p
    });
    let outs = e.generate(ps, &GenerationParams::greedy(14)).unwrap();
    assert!(outs.iter().all(|o| o.as_ref().unwrap().token_ids.len() == 14));
    assert_kv_empty(&e);
    let too_big = e.add_request(vec![1; 40], GenerationParams::greedy(40));
    assert!(matches!(too_big, Err(ponder::Error::KvExhausted { .. })), "{too_big:?}");
}

/// The built-in diffusion scheduler behind a hook that sees (and may change) each launch: a
/// scheduler of one's own, written against the public API.
struct Hooked {
    inner: ponder::diffusion::DiffusionBatching,
    name: &'static str,
    hook: Box<dyn FnMut(&mut ponder::diffusion::DenoiseLaunch) + Send>,
}
impl ponder::diffusion::DiffusionScheduler for Hooked {
    fn name(&self) -> &'static str {
        self.name
    }
    fn schedule(&mut self, requests: &mut ponder::scheduler::Requests) -> Option<ponder::diffusion::DenoiseLaunch> {
        let mut l = self.inner.schedule(requests)?;
        (self.hook)(&mut l);
        Some(l)
    }
    fn complete(
        &mut self,
        requests: &mut ponder::scheduler::Requests,
        l: &ponder::diffusion::DenoiseLaunch,
        r: &ponder::diffusion::DenoiseResult,
    ) -> Vec<ponder::diffusion::Emitted> {
        self.inner.complete(requests, l, r)
    }
    fn finished(&mut self, id: RequestId) {
        self.inner.finished(id)
    }
}

/// A scheduler of your own for a diffusion model, written against the public API: this one
/// wraps the built-in one and counts the launches it issues; outputs must not change.
#[test]
fn custom_diffusion_scheduler_plugs_in() {
    use ponder::diffusion::DiffusionBatching;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let (_, dir) = family_dirs(tmp.path()).remove(0);
    let ps = diffusion_prompts(3, 17);
    let want = engine(&dir, Box::new(StaticCount::new(2).unwrap()), Mode::Sdar { delayed: false }, 3)
        .generate(ps.clone(), &GenerationParams::greedy(10))
        .unwrap()
        .into_iter()
        .map(|o| o.unwrap().token_ids)
        .collect::<Vec<_>>();
    let launches = Arc::new(AtomicUsize::new(0));
    let counter = launches.clone();
    let mut e = EngineBuilder::new(&dir)
        .block_size(4)
        .diffusion(|o| o.block_length(8))
        .max_num_seqs(3)
        .kv_capacity_tokens(2048)
        .diffusion(|o| {
            o.unmask_policy(StaticCount::new(2).unwrap()).custom_scheduler(move |ctx| {
                let hook = Box::new(move |_: &mut ponder::diffusion::DenoiseLaunch| {
                    counter.fetch_add(1, Ordering::Relaxed);
                });
                Box::new(Hooked { inner: DiffusionBatching::new(ctx.config, ctx.limits, ctx.policy), name: "counting-diffusion", hook })
            })
        })
        .build()
        .unwrap();
    assert_eq!(e.scheduler_name(), "counting-diffusion");
    let got: Vec<Vec<u32>> = e.generate(ps, &GenerationParams::greedy(10)).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect();
    assert_eq!(got, want);
    assert!(launches.load(Ordering::Relaxed) > 0);
    assert_kv_empty(&e);
}

/// A custom diffusion scheduler with a bug (`defect` spoils each launch of the built-in one):
/// the launch fails its requests with a typed reason and frees their KV; nothing panics.
#[test]
fn malformed_denoise_launches_fail_their_requests() {
    use ponder::diffusion::{DenoiseLaunch, DiffusionBatching};
    type Defect = (&'static str, fn(&mut DenoiseLaunch));
    let defects: [Defect; 5] = [
        ("readout past the tokens", |l| l.rows[0].readout.push(10_000)),
        ("positions out of order", |l| l.rows[0].positions = (0..l.rows[0].tokens.len() as u32).rev().collect()),
        ("positions missing", |l| l.rows[0].positions.clear()),
        ("table too short", |l| l.rows[0].block_table = l.rows[0].block_table[..0].into()),
        ("block outside the pool", |l| l.rows[0].block_table = vec![u32::MAX; 64].into()),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let (_, dir) = family_dirs(tmp.path()).remove(0);
    for (name, defect) in defects {
        let mut e = EngineBuilder::new(&dir)
            .block_size(4)
            .diffusion(|o| o.block_length(8))
            .kv_capacity_tokens(2048)
            .diffusion(|o| {
                o.custom_scheduler(move |ctx| {
                    Box::new(Hooked { inner: DiffusionBatching::new(ctx.config, ctx.limits, ctx.policy), name: "spoiled-diffusion", hook: Box::new(defect) })
                })
            })
            .build()
            .unwrap();
        let out = e.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(6)).unwrap().remove(0).unwrap();
        assert!(matches!(out.finish_reason, ponder::FinishReason::Error(ref m) if m.contains("invalid launch")), "{name}: {:?}", out.finish_reason);
        assert_kv_empty(&e);
    }
}

/// The references' own schedules batch like the others: LLaDA's linear schedule over exact
/// whole-canvas steps, and Dream's sampler (one block of the whole generation, timestep
/// schedule, every confidence order), batched == each request alone, KV empty afterwards.
#[test]
fn reference_schedules_are_batch_invariant() {
    use ponder::diffusion::{Confidence, LinearSchedule};
    let tmp = tempfile::tempdir().unwrap();
    let dirs = family_dirs(tmp.path());
    let ps = diffusion_prompts(5, 9);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 6 + (i * 5) % 11).collect();
    type Make = Box<dyn Fn(&Path) -> Engine>;
    let linear = |width: usize| -> Make {
        Box::new(move |dir: &Path| {
            EngineBuilder::new(dir)
                .block_size(4)
                .max_num_seqs(width)
                .diffusion(|o| o.block_length(4).max_steps_per_block(3).unmask_policy(LinearSchedule::new(3).unwrap()))
                .build()
                .unwrap()
        })
    };
    let dream = |width: usize, order: Confidence| -> Make {
        Box::new(move |dir: &Path| EngineBuilder::new(dir).block_size(4).max_num_seqs(width).diffusion(|o| o.dream_sampler(7, order)).build().unwrap())
    };
    let mut cases: Vec<(String, &Path, Make, Make)> = vec![("llada × linear".into(), dirs[1].1.as_path(), linear(1), linear(3))];
    for order in [Confidence::Probability, Confidence::Margin, Confidence::NegEntropy] {
        cases.push((format!("dream × sampler {order:?}"), dirs[2].1.as_path(), dream(1, order), dream(3, order)));
    }
    let mut outs = Vec::new();
    for (label, dir, solo, wide) in &cases {
        let mut solo = solo(dir);
        let want: Vec<Vec<u32>> =
            ps.iter().zip(&max_new).map(|(p, &n)| solo.generate([p.clone()], &GenerationParams::greedy(n)).unwrap().remove(0).unwrap().token_ids).collect();
        let mut batched = wide(dir);
        let ids: Vec<RequestId> = ps.iter().zip(&max_new).map(|(p, &n)| batched.add_request(p.clone(), GenerationParams::greedy(n)).unwrap()).collect();
        let (mut got, mut events) = (HashMap::new(), 0);
        drain(&mut batched, &mut got, &mut events);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(got.get(id).cloned().unwrap_or_default(), want[i], "{label}: request {i}");
        }
        assert_kv_empty(&batched);
        outs.push(want);
    }
    assert!(outs[1] != outs[2] || outs[1] != outs[3], "the confidence orders decode differently somewhere");
    // A schedule of more steps than the context window has positions is refused, not run.
    let endless = EngineBuilder::new(&dirs[2].1).max_model_len(64).diffusion(|o| o.block_length(32).dream_sampler(65, Confidence::Probability)).build();
    assert!(matches!(endless, Err(ponder::Error::InvalidOption(ref m)) if m.contains("65 steps")), "{:?}", endless.err());
    assert!(EngineBuilder::new(&dirs[2].1).max_model_len(64).diffusion(|o| o.block_length(32).dream_sampler(64, Confidence::Probability)).build().is_ok());
}

/// Sampled requests (temperature, top-k, top-p, seeds) beside greedy ones: each decodes the same
/// tokens alone as in a batch, under every family's sampler and a cache or FOCUS; a seed
/// reproduces its tokens and another seed changes them.
#[test]
fn sampled_decoding_is_seeded_and_batch_invariant() {
    use ponder::diffusion::Focus;
    use ponder::SamplingParams;
    let tmp = tempfile::tempdir().unwrap();
    let ps = diffusion_prompts(5, 3);
    let sampled = |t: f32, k: Option<usize>, p: Option<f32>, seed: u64, n: usize| GenerationParams {
        sampling: SamplingParams { temperature: t, top_k: k, top_p: p, seed: Some(seed) },
        ..GenerationParams::greedy(n)
    };
    let params = |seed: u64| {
        vec![
            sampled(0.8, None, None, seed, 11),
            GenerationParams::greedy(9),
            sampled(1.0, Some(5), Some(0.9), seed + 1, 13),
            sampled(0.5, None, Some(0.8), seed + 2, 7),
            sampled(1.2, Some(3), None, seed + 3, 10),
        ]
    };
    for (family, dir) in family_dirs(tmp.path()) {
        let build = |width: usize| {
            let b = EngineBuilder::new(&dir)
                .block_size(4)
                .diffusion(|o| o.block_length(8))
                .max_num_seqs(width)
                .max_num_batched_tokens(256)
                .kv_capacity_tokens(2048);
            match family {
                "sdar" => b.diffusion(|o| o.delayed_cache(true).eviction_policy(Focus::default())),
                "llada" => b.diffusion(|o| o.canvas_cache(CanvasCache::Dual)),
                _ => b,
            }
            .build()
            .unwrap()
        };
        let mut solo = build(1);
        let alone = |solo: &mut Engine, params: &[GenerationParams]| -> Vec<Vec<u32>> {
            ps.iter().zip(params).map(|(p, g)| solo.generate([p.clone()], g).unwrap().remove(0).unwrap().token_ids).collect()
        };
        let want = alone(&mut solo, &params(3));
        assert_eq!(alone(&mut solo, &params(3)), want, "{family}: a seed reproduces its tokens");
        let other = alone(&mut solo, &params(40));
        assert_ne!(other, want, "{family}: another seed draws other tokens");
        assert_eq!(other[1], want[1], "{family}: the greedy request does not depend on the others' seeds");
        let mut batched = build(4);
        let ids: Vec<RequestId> = ps.iter().zip(params(3)).map(|(p, g)| batched.add_request(p.clone(), g).unwrap()).collect();
        let (mut got, mut events) = (HashMap::new(), 0);
        drain(&mut batched, &mut got, &mut events);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(got.get(id).cloned().unwrap_or_default(), want[i], "{family}: request {i} batched");
        }
        assert_kv_empty(&batched);
        assert_kv_empty(&solo);
    }
}
