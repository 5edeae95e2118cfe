//! Chunked prefill never changes results: with a launch budget of 64 tokens (prompts up to 4×
//! that, prefilled in chunks) and of 8192 (every prompt in one launch), greedy output equals each
//! request run alone, for CB, depth batching (refill and no-refill) on every layout, and block
//! diffusion on SDAR, LLaDA and Dream — while other requests arrive, decode and are aborted — and
//! no KV block leaks. A long prompt's chunks never stall the requests already decoding.

mod common;
use common::*;
use ponder::diffusion::StaticCount;
use ponder::testing::{tiny_dream_config, tiny_llada_config, tiny_sdar_config, write_random_dream, write_random_llada, write_random_sdar};
use ponder::{Engine, EngineBuilder, Event, GenerationParams, KvLayoutKind, RequestId, SchedulerKind};
use std::collections::HashMap;
use std::path::Path;

const BUDGETS: [usize; 2] = [64, 8192];

/// Short prompts with long ones among them (70, 200 and 256 tokens), avoiding the last id of
/// the vocabulary (the tiny diffusion models' mask token).
fn mixed_prompts(seed: u64) -> Vec<Vec<u32>> {
    let mut ps = diffusion_prompts(7, seed);
    let long = |n: usize, k: u32| (0..n as u32).map(|i| (i * 7 + k) % (VOCAB as u32 - 1)).collect::<Vec<u32>>();
    ps[1] = long(200, 3);
    ps[3] = long(256, 11);
    ps[5] = long(70, 5);
    ps
}

/// Requests arrive one every other step; request 3 (256 tokens) is aborted two steps after it
/// arrives — mid-prefill at the small budget — and request 4 once it is decoding. Returns the
/// tokens of every request that was not aborted, by prompt index.
fn with_arrivals_and_aborts(engine: &mut Engine, ps: &[Vec<u32>], max_new: &[usize]) -> HashMap<usize, Vec<u32>> {
    let mut ids: Vec<RequestId> = Vec::new();
    let mut got: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut step = 0;
    let mut abort_at: HashMap<usize, usize> = HashMap::new();
    while ids.len() < ps.len() || engine.has_work() {
        if step % 2 == 0 && ids.len() < ps.len() {
            let i = ids.len();
            ids.push(engine.add_request(ps[i].clone(), GenerationParams::greedy(max_new[i])).unwrap());
            if i == 3 {
                abort_at.insert(3, step + 2);
            }
        }
        if ids.len() > 4 && !abort_at.contains_key(&4) && got.get(&ids[4]).is_some_and(|t| !t.is_empty()) {
            abort_at.insert(4, step);
        }
        for (&i, &at) in &abort_at {
            if at == step {
                engine.abort(ids[i]).unwrap();
            }
        }
        for ev in engine.step().unwrap() {
            if let Event::Token { id, token, .. } = ev {
                got.entry(id).or_default().push(token);
            }
        }
        step += 1;
        assert!(step < 100_000, "the engine does not finish");
    }
    (0..ps.len()).filter(|i| !abort_at.contains_key(i)).map(|i| (i, got.remove(&ids[i]).unwrap_or_default())).collect()
}

fn check(label: &str, want: &[Vec<u32>], got: &HashMap<usize, Vec<u32>>) {
    assert_eq!(got.len(), want.len() - 2, "{label}: two requests aborted");
    for (&i, tokens) in got {
        assert_eq!(tokens, &want[i], "{label}: request {i}");
    }
}

/// One gate per (scheduler, layout): Q-exit where the layout allows early exits, else a
/// minimum-depth-2 replay, else full depth.
fn looped_combos() -> Vec<Combo> {
    let mut out: Vec<Combo> = Vec::new();
    for c in combos() {
        if out.iter().any(|o| o.scheduler == c.scheduler && o.layout == c.layout) {
            continue;
        }
        let rank = |n: &str| ["q-exit", "replay-min2", "fixed4"].iter().position(|g| n.ends_with(g));
        let best = combos()
            .into_iter()
            .filter(|o| o.scheduler == c.scheduler && o.layout == c.layout)
            .filter(|o| rank(&o.name).is_some())
            .min_by_key(|o| rank(&o.name));
        out.extend(best);
    }
    out
}

#[test]
fn looped_chunked_equals_unchunked() {
    let (_tmp, dir) = tiny_dir(61);
    let ps = mixed_prompts(5);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 5 + (i * 3) % 7).collect();
    let combos = looped_combos();
    assert_eq!(combos.len(), 12, "3 schedulers × 4 layouts");
    for c in &combos {
        let mut solo = combo_builder(&dir, c, 1).max_num_batched_tokens(8192).build().unwrap();
        let want = sequential(&mut solo, &ps, &max_new);
        // Alone at the small budget, each prompt takes one prefill launch per 64 tokens — or one
        // launch where loop steps share a cache slot, as chunks would change the function there.
        let mut chunked = combo_builder(&dir, c, 1).max_num_batched_tokens(64).build().unwrap();
        assert_eq!(sequential(&mut chunked, &ps, &max_new), want, "{} alone at budget 64", c.name);
        let whole = matches!(c.layout, KvLayoutKind::Shared | KvLayoutKind::FirstThenShared);
        let chunks: usize = ps.iter().map(|p| if whole { 1 } else { p.len().div_ceil(64) }).sum();
        assert_eq!(chunked.metrics().stages["prefill"].launches, chunks as u64, "{}", c.name);
        for budget in BUDGETS {
            let mut engine = combo_builder(&dir, c, 3).max_num_batched_tokens(budget).build().unwrap();
            let got = with_arrivals_and_aborts(&mut engine, &ps, &max_new);
            check(&format!("{} at budget {budget}", c.name), &want, &got);
            assert_kv_empty(&engine);
        }
    }
}

fn diffusion_engine(dir: &Path, width: usize, budget: usize) -> Engine {
    EngineBuilder::new(dir)
        .block_size(4)
        .max_num_seqs(width)
        .max_num_batched_tokens(budget)
        .kv_capacity_tokens(4096)
        .diffusion(|o| o.block_length(8).unmask_policy(StaticCount::new(3).unwrap()))
        .build()
        .unwrap()
}

#[test]
fn diffusion_chunked_equals_unchunked() {
    let tmp = tempfile::tempdir().unwrap();
    let sdar = tmp.path().join("sdar");
    write_random_sdar(&sdar, &tiny_sdar_config(VOCAB), 15).unwrap();
    let llada = tmp.path().join("llada");
    write_random_llada(&llada, &tiny_llada_config(VOCAB), 16).unwrap();
    let dream = tmp.path().join("dream");
    write_random_dream(&dream, &tiny_dream_config(VOCAB), 17).unwrap();
    let ps = mixed_prompts(9);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 5 + (i * 5) % 11).collect();
    for (family, dir) in [("sdar", sdar), ("llada", llada), ("dream", dream)] {
        let mut solo = diffusion_engine(&dir, 1, 8192);
        let want = sequential(&mut solo, &ps, &max_new);
        let mut prefill_rows = Vec::new();
        for budget in BUDGETS {
            let mut engine = diffusion_engine(&dir, 3, budget);
            let got = with_arrivals_and_aborts(&mut engine, &ps, &max_new);
            check(&format!("{family} at budget {budget}"), &want, &got);
            assert_kv_empty(&engine);
            prefill_rows.push(engine.metrics().denoise().unwrap().other_rows);
        }
        // SDAR prefills its long prompts' blocks in chunks; bidirectional canvases are not split.
        if family == "sdar" {
            assert!(prefill_rows[0] >= prefill_rows[1] + 3, "{family}: prefill and commit rows {prefill_rows:?}");
        }
    }
}

#[test]
fn a_sixteen_chunk_prefill_never_stalls_decoding_requests() {
    let (_tmp, dir) = tiny_dir(62);
    let budget = 16;
    let mut engine =
        builder(&dir, KvLayoutKind::DepthIndexed, 4).max_num_batched_tokens(budget).looped(|o| o.scheduler(SchedulerKind::Continuous)).build().unwrap();
    let short: Vec<RequestId> = (0..3).map(|i| engine.add_request(vec![1 + i, 2, 3], GenerationParams::greedy(200)).unwrap()).collect();
    engine.step().unwrap();
    let long = engine.add_request((0..16 * budget as u32).map(|i| i % 90).collect::<Vec<u32>>(), GenerationParams::greedy(4)).unwrap();
    let mut last_token: HashMap<RequestId, usize> = short.iter().map(|&id| (id, 0)).collect();
    let mut launch = 0;
    loop {
        launch += 1;
        let events = engine.step().unwrap();
        for ev in &events {
            if let Event::Token { id, .. } = ev {
                last_token.insert(*id, launch);
            }
        }
        for id in &short {
            assert!(launch - last_token[id] < 2, "request {id:?} got no token for two launches (launch {launch})");
        }
        if last_token.contains_key(&long) {
            break;
        }
    }
    assert!(launch >= 2 * 16 - 1, "16 chunks interleaved with decodes take at least 31 launches, took {launch}");
    for id in short {
        engine.abort(id).unwrap();
    }
    while engine.has_work() {
        engine.step().unwrap();
    }
    assert_kv_empty(&engine);
}
