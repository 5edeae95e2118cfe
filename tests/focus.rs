//! FOCUS eviction through the public engine on a tiny random SDAR, and its selection rules
//! under random masks and scores.

use ponder::diffusion::{enforce_rules, EvictionInput, EvictionPolicy, Focus, NoEviction, StaticCount, Threshold};
use ponder::testing::{tiny_dream_config, tiny_llada2_config, tiny_sdar_config, write_random_dream, write_random_llada2, write_random_sdar};
use ponder::{Engine, EngineBuilder, GenerationParams, RequestId};
use proptest::prelude::*;
mod common;
use common::{diffusion_prompts, VOCAB};
use std::collections::HashMap;
use std::path::Path;

/// Block 16 over a cache page of 4: a block holds enough masked tokens for the budget to bite.
fn builder(dir: &Path, width: usize) -> EngineBuilder {
    EngineBuilder::new(dir)
        .block_size(4)
        .diffusion(|o| o.block_length(16))
        .max_num_seqs(width)
        .kv_capacity_tokens(4096)
        .diffusion(|o| o.unmask_policy(Threshold::new(0.5).unwrap()))
}

fn run_all(e: &mut Engine, ps: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let ids: Vec<RequestId> = ps.iter().map(|p| e.add_request(p.clone(), GenerationParams::greedy(n)).unwrap()).collect();
    let mut got: HashMap<RequestId, Vec<u32>> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let ponder::Event::Token { id, token, .. } = ev {
                got.entry(id).or_default().push(token);
            }
        }
    }
    assert_eq!(e.requests().kv().num_used_blocks(), 0, "KV leaked");
    ids.iter().map(|id| got.remove(id).unwrap_or_default()).collect()
}

fn sdar_dir(tmp: &Path) -> std::path::PathBuf {
    let dir = tmp.join("sdar");
    write_random_sdar(&dir, &tiny_sdar_config(VOCAB), 21).unwrap();
    dir
}

/// A tiny LLaDA2.0 (MoE layers after the first): eviction at layer 1 skips attention and the
/// experts of every later layer for the evicted tokens.
fn llada2_dir(tmp: &Path) -> std::path::PathBuf {
    let dir = tmp.join("llada2");
    write_random_llada2(&dir, &tiny_llada2_config(VOCAB), 21).unwrap();
    dir
}

#[test]
fn focus_evicts_reveals_only_kept_tokens_and_is_batch_invariant() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in [sdar_dir(tmp.path()), llada2_dir(tmp.path())] {
        focus_on(&dir);
    }
}

fn focus_on(dir: &Path) {
    let ps = diffusion_prompts(5, 4);
    let focus = || builder(dir, 4).diffusion(|o| o.delayed_cache(true).eviction_policy(Focus::default()));
    let mut batched = focus().build().unwrap();
    let got = run_all(&mut batched, &ps, 24);
    let d = batched.metrics().denoise().unwrap().clone();
    assert!(d.scored_steps > 0);
    assert!(d.eviction_ratio() > 0.05, "FOCUS evicted {:.3} of scored tokens", d.eviction_ratio());
    assert!(d.kept_per_step() < d.tokens_per_step(), "{} kept vs {} processed per step", d.kept_per_step(), d.tokens_per_step());
    assert_eq!(d.recall(), Some(1.0), "every revealed token was in its step's kept set");
    // Each request alone: same tokens (eviction decisions are per request).
    let mut solo = focus().max_num_seqs(1).build().unwrap();
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(run_all(&mut solo, std::slice::from_ref(p), 24)[0], got[i], "{}: request {i}", dir.display());
    }
    assert!(got.iter().all(|t| t.len() == 24));
}

#[test]
fn no_eviction_and_shadow_scoring_leave_the_baseline_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sdar_dir(tmp.path());
    let ps = diffusion_prompts(4, 8);
    let base = run_all(&mut builder(&dir, 4).diffusion(|o| o.delayed_cache(true)).build().unwrap(), &ps, 20);
    let none = run_all(&mut builder(&dir, 4).diffusion(|o| o.delayed_cache(true).eviction_policy(NoEviction)).build().unwrap(), &ps, 20);
    assert_eq!(none, base);
    let mut shadow = builder(&dir, 4).diffusion(|o| o.delayed_cache(true).eviction_policy(Focus::default()).eviction_shadow(true)).build().unwrap();
    assert_eq!(run_all(&mut shadow, &ps, 20), base, "shadow scoring must not change what runs");
    let recall = shadow.metrics().denoise().unwrap().recall().unwrap();
    assert!(recall > 0.0 && recall <= 1.0, "recall {recall}");
}

#[test]
fn focus_needs_the_delayed_cache_and_unshifted_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sdar_dir(tmp.path());
    let e = builder(&dir, 2).diffusion(|o| o.eviction_policy(Focus::default())).build();
    assert!(matches!(e, Err(ponder::Error::InvalidOption(_))));
    let dream = tmp.path().join("dream");
    write_random_dream(&dream, &tiny_dream_config(VOCAB), 3).unwrap();
    let e = EngineBuilder::new(&dream).diffusion(|o| o.block_length(16).delayed_cache(true).eviction_policy(Focus::default())).build();
    assert!(matches!(e, Err(ponder::Error::InvalidOption(_))));
    // Looped models take no eviction policy.
    assert!(Focus::new(0.9).is_err());
    let _ = StaticCount::new(1).unwrap();
}

/// Phase timing names FOCUS's phases, accounts for (almost) the whole launch time, changes no
/// token, and is refused for looped models.
#[test]
fn phase_timing_covers_focus_launches_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sdar_dir(tmp.path());
    let ps = diffusion_prompts(4, 6);
    let focus = || builder(&dir, 4).diffusion(|o| o.delayed_cache(true).eviction_policy(Focus::default()));
    let want = run_all(&mut focus().build().unwrap(), &ps, 16);
    let mut timed = focus().diffusion(|o| o.time_denoise_phases(true)).build().unwrap();
    assert_eq!(run_all(&mut timed, &ps, 16), want, "timing must not change the tokens");
    let m = timed.metrics();
    let names: Vec<&str> = m.denoise().unwrap().phases.iter().map(|(p, _)| *p).collect();
    for p in ["embed + rope", "layers 0-1 + importance", "selection", "compaction", "layers past 1", "lm head + readout"] {
        assert!(names.contains(&p), "phase {p} missing from {names:?}");
    }
    let phases: f64 = m.denoise().unwrap().phases.iter().map(|(_, d)| d.as_secs_f64()).sum();
    let launches = m.stages["denoise"].time.as_secs_f64();
    assert!(phases > 0.0 && phases <= launches * 1.001, "phases {phases} s vs launches {launches} s");
    assert!(builder(&dir, 4).build().unwrap().metrics().denoise().unwrap().phases.is_empty(), "off by default");
    let ouro = tmp.path().join("ouro");
    ponder::testing::write_random_ouro(&ouro, &ponder::testing::tiny_ouro_config(VOCAB), 1).unwrap();
    let looped = EngineBuilder::new(&ouro).diffusion(|o| o.time_denoise_phases(true)).build();
    assert!(matches!(looped, Err(ponder::Error::WrongFamily { .. })), "diffusion-only option on a looped model");
    // Device-span timing is the looped models' counterpart (CUDA only: nothing is timed here).
    let mut timed = EngineBuilder::new(&ouro).looped(|o| o.time_device(true)).build().unwrap();
    timed.add_request(vec![1, 2, 3], GenerationParams::greedy(3)).unwrap();
    while timed.has_work() {
        timed.step().unwrap();
    }
    assert!(timed.metrics().stages.values().all(|s| s.device_timed == 0), "no device spans off CUDA");
    let on_diffusion = builder(&dir, 2).looped(|o| o.time_device(true)).build();
    assert!(matches!(on_diffusion, Err(ponder::Error::WrongFamily { .. })), "looped-only option on a diffusion model");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Selection + rules over random masks, scores, running means and progress.
    #[test]
    fn focus_selection_invariants(
        mask_bits in proptest::collection::vec(any::<bool>(), 1..33),
        scores in proptest::collection::vec(-4.0f32..4.0, 32),
        avg in 0.0f32..8.0,
        progress in -1i64..32,
        alpha in 1.0f32..3.0,
        knee in prop_oneof![Just(0usize), 1usize..4096],
        launch_tokens in 1usize..4096,
    ) {
        let positions: Vec<u32> = mask_bits.iter().enumerate().filter(|(_, &b)| b).map(|(i, _)| i as u32).collect();
        prop_assume!(!positions.is_empty());
        let m = positions.len();
        let delta = &scores[..m];
        let f = Focus::new(alpha).unwrap().with_knee(knee);
        let keep = f.keep(&EvictionInput { delta, positions: &positions, avg_decoded: avg, block_progress: progress, launch_tokens });
        prop_assert_eq!(keep.len(), m);
        let input = EvictionInput { delta, positions: &positions, avg_decoded: avg, block_progress: progress, launch_tokens };
        let t = f.budget_for(&input);
        // A knee only ever raises the budget, never past 4x the published rule's α.
        prop_assert!(t >= Focus::new(alpha).unwrap().budget(m, avg));
        prop_assert!(f.alpha_for(launch_tokens) <= alpha * Focus::MAX_BOOST + 1e-6);
        let kept = keep.iter().filter(|&&k| k).count();
        prop_assert!(kept >= t.min(m), "kept {} < budget {}", kept, t);
        if m <= t {
            prop_assert!(keep.iter().all(|&k| k));
        }
        // The top-Δ token is always kept.
        let best = (0..m).max_by(|&a, &b| delta[a].total_cmp(&delta[b]).then(b.cmp(&a))).unwrap();
        prop_assert!(keep[best]);
        // Rule 3: no evicted token strictly between block_progress and the rightmost kept one.
        let r = positions[(0..m).rev().find(|&i| keep[i]).unwrap()] as i64;
        for i in 0..m {
            let p = positions[i] as i64;
            prop_assert!(keep[i] || !(p < r && p > progress), "evicted {} inside ({}, {})", p, progress, r);
        }
        // Rules are idempotent on their own output except rule 1's single pass: applying them
        // again never removes a kept token.
        let mut again = keep.clone();
        enforce_rules(&mut again, &positions, progress);
        for i in 0..m {
            prop_assert!(again[i] || !keep[i]);
        }
        // NoEviction keeps all.
        let all = NoEviction.keep(&EvictionInput { delta, positions: &positions, avg_decoded: avg, block_progress: progress, launch_tokens });
        prop_assert!(all.iter().all(|&k| k));
    }
}

/// Keeps none of a row's masked tokens (a policy breaking its contract).
#[derive(Debug)]
struct KeepNothing;
impl EvictionPolicy for KeepNothing {
    fn name(&self) -> String {
        "keep-nothing".into()
    }
    fn keep(&self, input: &EvictionInput) -> Vec<bool> {
        vec![false; input.positions.len()]
    }
}

#[test]
fn a_policy_that_keeps_nothing_is_overruled_for_that_row() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sdar_dir(tmp.path());
    let ps = diffusion_prompts(3, 9);
    let want = run_all(&mut builder(&dir, 3).diffusion(|o| o.delayed_cache(true)).build().unwrap(), &ps, 20);
    let mut e = builder(&dir, 3).diffusion(|o| o.delayed_cache(true).eviction_policy(KeepNothing)).build().unwrap();
    assert_eq!(run_all(&mut e, &ps, 20), want, "every row runs whole, as without eviction");
}

/// Keeps everything and records, per call, the launch's token count and the row's masked count.
#[derive(Debug, Default)]
struct RecordLoad(std::sync::Arc<std::sync::Mutex<Vec<(usize, usize)>>>);
impl EvictionPolicy for RecordLoad {
    fn name(&self) -> String {
        "record-load".into()
    }
    fn keep(&self, input: &EvictionInput) -> Vec<bool> {
        self.0.lock().unwrap().push((input.launch_tokens, input.positions.len()));
        vec![true; input.positions.len()]
    }
}

#[test]
fn a_policy_sees_the_token_count_of_its_launch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sdar_dir(tmp.path());
    let ps = diffusion_prompts(3, 9);
    let want = run_all(&mut builder(&dir, 3).diffusion(|o| o.delayed_cache(true)).build().unwrap(), &ps, 20);
    let seen = RecordLoad::default();
    let log = seen.0.clone();
    let mut e = builder(&dir, 3).diffusion(|o| o.delayed_cache(true).eviction_policy(seen)).build().unwrap();
    assert_eq!(run_all(&mut e, &ps, 20), want, "keeping everything is the delayed cache");
    let log = log.lock().unwrap();
    assert!(!log.is_empty());
    // Every row's count covers its masked tokens; a row alone runs at most one 16-block, so a
    // count past 16 is several rows' (three requests decode together).
    for &(tokens, masked) in log.iter() {
        assert!(tokens >= masked && masked > 0, "launch of {tokens} tokens for a row with {masked} masked");
    }
    assert!(log.iter().any(|&(tokens, _)| tokens > 16), "no launch counted more than one row: {log:?}");
}
