//! Builds a byte-level BPE tokenizer (4096 ids, `<|endoftext|>` = 0) trained on The Rust
//! Programming Language (MIT OR Apache-2.0, shipped with the toolchain's `rust-docs` component)
//! and an Ouro-architecture model with deterministic random bf16 weights in the real checkpoint
//! layout: a model directory for tests and benchmarks that needs no training.
//!
//!     cargo run --release --example make_assets -- [BOOK_HTML_DIR] [OUT_DIR=target/tiny-ouro-random]
//!
//! The shipped `assets/tiny-ouro` and `assets/tiny-sdar` do not use this tokenizer: theirs comes
//! from `tools/train/make_tokenizer.py` (twelve rust-docs books, `<|mask|>` = 1), their weights
//! from `tools/train/train_ouro.py` and `train_sdar.py` (see their `README.md`).

use ponder::config::EosIds;
use ponder::looped::models::OuroConfig;
use ponder::testing::{rust_book_chapters, rust_book_dir, train_byte_level_bpe, write_random_ouro_as};
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let book = args.next().map(PathBuf::from).map_or_else(rust_book_dir, Ok)?;
    let out = args.next().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/tiny-ouro-random"));
    let corpus = rust_book_chapters(&book)?;
    let words: usize = corpus.iter().map(|t| t.split_whitespace().count()).sum();
    eprintln!("corpus: {} chapters, {words} words from {}", corpus.len(), book.display());

    let tokenizer = train_byte_level_bpe(&corpus, 4096, &["<|endoftext|>"])?;
    let cfg = OuroConfig {
        vocab_size: tokenizer.get_vocab_size(true),
        hidden_size: 256,
        intermediate_size: 768,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: Some(4),
        head_dim: Some(64),
        max_position_embeddings: 2048,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        total_ut_steps: 4,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_id: Some(EosIds::One(0)),
        model_type: "ouro".into(),
    };
    write_random_ouro_as(&out, &cfg, 2026, candle_core::DType::BF16)?;
    tokenizer.save(out.join("tokenizer.json"), false).map_err(|e| e.to_string())?;
    eprintln!("wrote {} (vocab {})", out.display(), cfg.vocab_size);
    Ok(())
}
