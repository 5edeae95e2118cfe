//! Shared helpers: tiny random-weight Ouro models in the real checkpoint layout.
#![allow(dead_code)]

use ponder::models::OuroConfig;
use ponder::testing::{tiny_ouro_config, write_random_ouro};
use ponder::{Engine, EngineBuilder, GenerationParams, KvLayoutKind, RequestId};
use std::collections::HashMap;
use std::path::PathBuf;

pub const VOCAB: usize = 97;

/// A tiny Ouro directory (no tokenizer) in a fresh temp dir.
pub fn tiny_dir(seed: u64) -> (tempfile::TempDir, PathBuf) {
    tiny_dir_with(tiny_ouro_config(VOCAB), seed)
}

pub fn tiny_dir_with(cfg: OuroConfig, seed: u64) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny-ouro");
    write_random_ouro(&dir, &cfg, seed).unwrap();
    (tmp, dir)
}

pub fn builder(dir: &PathBuf, layout: KvLayoutKind, width: usize) -> EngineBuilder {
    EngineBuilder::new(dir).kv_layout(layout).max_num_seqs(width).block_size(4).max_num_batched_tokens(512)
}

/// Deterministic prompts of varied lengths (1..=19 tokens).
pub fn prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    (0..n).map(|_| (0..1 + next() % 19).map(|_| next() % VOCAB as u32).collect()).collect()
}

/// Each prompt generated alone, one after another, greedy.
pub fn sequential(engine: &mut Engine, prompts: &[Vec<u32>], max_new: &[usize]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .zip(max_new)
        .map(|(p, &n)| {
            let out = engine.generate([p.clone()], &GenerationParams::greedy(n)).unwrap().remove(0).unwrap();
            out.token_ids
        })
        .collect()
}

/// Drives `engine` until idle, collecting tokens per request.
pub fn drain(engine: &mut Engine, outputs: &mut HashMap<RequestId, Vec<u32>>) {
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let ponder::Event::Token { id, token, .. } = ev {
                outputs.entry(id).or_default().push(token);
            }
        }
    }
}

pub fn assert_kv_empty(engine: &Engine) {
    let kv = engine.scheduler().kv();
    assert_eq!(kv.num_used_blocks(), 0, "KV blocks leaked");
    assert_eq!(kv.num_resident(), 0, "requests still hold KV tables");
}
