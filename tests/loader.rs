//! Loading model directories: single file, sharded index, the shipped asset, tokenizer + eos.

mod common;
use common::*;
use ponder::config::ModelConfig;
use ponder::loader::ModelDir;
use ponder::testing::{ouro_tensor_manifest, tiny_ouro_config};
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind};
use std::collections::HashMap;

#[test]
fn sharded_checkpoint_loads_like_single_file() {
    let (tmp, dir) = tiny_dir(21);
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let sharded = tmp.path().join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(dir.join(f), sharded.join(f)).unwrap();
    }
    // Three shards, assignment by name order, as the index says.
    let mut names: Vec<_> = tensors.keys().cloned().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(names.len().div_ceil(3)).enumerate() {
        let file = format!("model-0000{}-of-00003.safetensors", i + 1);
        let part: HashMap<_, _> = chunk.iter().map(|n| (n.clone(), tensors[n].clone())).collect();
        candle_core::safetensors::save(&part, sharded.join(&file)).unwrap();
        for n in chunk {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_eq!(ModelDir::open(&sharded).unwrap().weight_files.len(), 3);

    let p = prompts(2, 4);
    let run = |d: &std::path::PathBuf| {
        let mut e = builder(d, KvLayoutKind::Shared, 2).build().unwrap();
        e.generate(p.clone(), &GenerationParams::greedy(6)).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect::<Vec<_>>()
    };
    assert_eq!(run(&dir), run(&sharded));
}

#[test]
fn real_ouro_tensor_names() {
    let cfg = ponder::looped::models::OuroConfig::ouro_1_4b();
    let m = ouro_tensor_manifest(&cfg);
    assert_eq!(m.len(), 24 * 11 + 5, "269 tensors in the released Ouro-1.4B checkpoint");
    let params: usize = m.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(params, 1_434_652_673);
    assert!(m.iter().any(|(n, s)| n == "model.layers.23.post_attention_layernorm_2.weight" && s == &vec![2048]));
    assert!(m.iter().any(|(n, s)| n == "model.early_exit_gate.weight" && s == &vec![1, 2048]));
}

#[test]
fn shipped_tiny_model_generates_text() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-ouro");
    let md = ModelDir::open(&dir).unwrap();
    assert!(matches!(md.config, ModelConfig::Ouro(_)));
    assert_eq!(md.eos_token_ids, vec![0]);
    let size: u64 = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert!(size <= 20 << 20, "asset is {size} bytes");

    let mut engine = EngineBuilder::new(&dir).build().unwrap();
    let ids = engine.encode("fn main() { println!(\"hi\"); }").unwrap();
    assert!(!ids.is_empty());
    let out = engine.generate(["Ownership"], &GenerationParams::greedy(12)).unwrap().remove(0).unwrap();
    assert!(!out.text.is_empty());
    // The text is the detokenisation of the ids (no token lost in streaming).
    let tok = engine.tokenizer().unwrap();
    assert_eq!(out.text, tok.decode(&out.token_ids, true).unwrap());
    // Stop strings cut the output before the stop text.
    let stop = out.text.chars().skip(3).take(3).collect::<String>();
    let params = GenerationParams { stop: vec![stop.clone()], ..GenerationParams::greedy(12) };
    let cut = engine.generate(["Ownership"], &params).unwrap().remove(0).unwrap();
    assert_eq!(cut.finish_reason, ponder::FinishReason::Stop(stop.clone()));
    assert!(out.text.starts_with(&cut.text) && !cut.text.contains(&stop));
    assert_eq!(engine.requests().kv().num_used_blocks(), 0);
}

#[test]
fn eos_from_generation_config() {
    let mut cfg = tiny_ouro_config(VOCAB);
    cfg.eos_token_id = Some(ponder::config::EosIds::Many(vec![5, 3]));
    let (_tmp, dir) = tiny_dir_with(cfg, 5);
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": 7}"#).unwrap();
    assert_eq!(ModelDir::open(&dir).unwrap().eos_token_ids, vec![3, 5, 7]);
}

#[test]
fn the_kv_pool_is_sized_from_memory_and_reported() {
    let (_tmp, dir) = tiny_dir(23);
    let spec_bytes = |e: &ponder::Engine| {
        let s = e.spec().looped().unwrap();
        (s.num_kv_layers * s.num_kv_heads * s.head_dim * 2 * 4) as u64
    };
    // CPU default: a fixed 16 384 positions per slot.
    let e = builder(&dir, KvLayoutKind::DepthIndexed, 2).build().unwrap();
    let pool = e.metrics().kv_pool;
    assert_eq!((pool.slots, pool.block_size, pool.tokens, pool.blocks), (4, 4, 4 * 16_384, 16_384));
    assert_eq!(pool.bytes, pool.tokens as u64 * spec_bytes(&e));
    // A fraction of free memory, capped at what 2 requests of the 512-position context can use
    // in 4 slots.
    let e = builder(&dir, KvLayoutKind::DepthIndexed, 2).kv_memory_fraction(0.5).build().unwrap();
    assert_eq!(e.metrics().kv_pool.tokens, 2 * 512 * 4);
    // Capped in whole blocks per slot: two requests of a 509-position context (128 blocks of 4
    // in each of 4 slots) fit at full length together.
    let mut e = builder(&dir, KvLayoutKind::DepthIndexed, 2).kv_memory_fraction(0.5).max_model_len(509).build().unwrap();
    assert_eq!(e.metrics().kv_pool.tokens, 2 * 512 * 4);
    let full = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(1) };
    let outs = e.generate([vec![3u32; 508], vec![4u32; 508]], &full).unwrap();
    assert!(outs.iter().all(|o| o.as_ref().is_ok_and(|o| o.token_ids.len() == 1)));
    // The explicit count overrides the fraction; a fraction out of range is refused.
    let e = builder(&dir, KvLayoutKind::Shared, 2).kv_memory_fraction(0.5).kv_capacity_tokens(64).build().unwrap();
    assert_eq!((e.metrics().kv_pool.tokens, e.metrics().kv_pool.slots), (64, 1));
    for bad in [0.0, 1.5, f64::NAN] {
        assert!(matches!(builder(&dir, KvLayoutKind::Shared, 2).kv_memory_fraction(bad).build(), Err(ponder::Error::InvalidOption(_))), "{bad}");
    }
}

#[test]
fn the_shipped_tiny_llada_loads_and_decodes_text() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-llada");
    let mut engine = EngineBuilder::new(dir).max_num_seqs(2).diffusion(|o| o.block_length(16)).build().unwrap();
    assert_eq!(engine.spec().diffusion().unwrap().model_type, "llada");
    let out = engine.generate(["fn main() {"], &GenerationParams { ignore_eos: true, ..GenerationParams::greedy(16) }).unwrap().remove(0).unwrap();
    assert_eq!(out.token_ids.len(), 16);
    assert!(!out.text.is_empty());
}

/// LLaDA2.0's released config names neither its mask, its EOS nor its end of turn: the mask and
/// EOS come from the family's defaults when the vocabulary holds them, and `<|role_end|>` ends a
/// request through the tokenizer's id for it.
#[test]
fn llada2_stops_on_its_end_of_turn_token() {
    use ponder::testing::{tiny_llada2_config, train_byte_level_bpe, write_random_llada2};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llada2");
    let texts: Vec<String> = (0..50).map(|i| format!("turn {i} of a short chat between two people")).collect();
    let tok = train_byte_level_bpe(&texts, 96, &["<|endoftext|>", "<|role_end|>"]).unwrap();
    let vocab = tok.get_vocab_size(true);
    let role_end = tok.token_to_id("<|role_end|>").unwrap();
    write_random_llada2(&dir, &tiny_llada2_config(vocab + 1), 3).unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let md = ModelDir::open(&dir).unwrap();
    assert!(md.eos_token_ids.contains(&role_end), "{:?} lacks <|role_end|> = {role_end}", md.eos_token_ids);
    assert!(matches!(md.config, ModelConfig::Llada2(_)));
    // Without a tokenizer there is nothing to look the token up in.
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert!(ModelDir::open(&dir).unwrap().eos_token_ids.is_empty());
}
