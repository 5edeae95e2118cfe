//! The model's tokenizer as the engine uses it. `tokenizer.json` is a file a checkpoint
//! supplies, and the tokenizers crate accepts values at load that it later panics or aborts on
//! (a `Strip` decoder past a token's length, an empty precompiled normalizer, a truncation
//! stride past its length, padding to 2⁴⁰ tokens). So: the file is read with its size bounded;
//! padding and truncation are switched off (a prompt is encoded alone and must reach the model
//! as written — a checkpoint's padding would append tokens to it, its truncation cut it); a
//! probe encodes and decodes at load, so a tokenizer that panics there is refused with a typed
//! error; and every encode and decode runs under `catch_unwind`, so one that panics later fails
//! its request, not the engine thread.

use crate::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use tokenizers::Tokenizer;

/// Text the load-time probe encodes and decodes back.
const PROBE: &str = "Hello, world! 123 — ÿ";

/// `path`'s tokenizer, checked as the module says.
pub(crate) fn parse(path: &Path) -> Result<Tokenizer> {
    let bytes = crate::loader::read_bounded(path)?;
    let refused = |e: String| Error::Tokenizer(format!("{}: {e}", path.display()));
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(&bytes) {
        precompiled_charsmaps_hold_their_tries(&json).map_err(refused)?;
    }
    let mut tok = guarded(|| Tokenizer::from_bytes(&bytes).map_err(|e| e.to_string())).map_err(refused)?;
    tok.with_padding(None);
    tok.with_truncation(None).map_err(|e| refused(e.to_string()))?;
    let ids = encode(&tok, PROBE).map_err(|e| refused(format!("encoding a probe text: {e}")))?;
    // The probe's ids, and the vocabulary's first ids (special tokens and bytes, where decoders
    // such as `Strip` and `ByteFallback` meet their edge cases).
    let first: Vec<u32> = (0..tok.get_vocab_size(true).min(256) as u32).collect();
    for probe in [&ids[..], &first[..]] {
        for skip_special in [true, false] {
            decode(&tok, probe, skip_special).map_err(|e| refused(format!("decoding probe ids: {e}")))?;
            for id in probe {
                decode(&tok, std::slice::from_ref(id), skip_special).map_err(|e| refused(format!("decoding token {id}: {e}")))?;
            }
        }
    }
    Ok(tok)
}

/// A `Precompiled` normalizer's charsmap (base64) starts with its trie's size in bytes (u32,
/// little-endian), which the tokenizers crate reserves memory for before reading the trie: a
/// size past the data it comes with is refused here rather than reserved (`/////w==` would ask
/// for 8 GiB).
fn precompiled_charsmaps_hold_their_tries(json: &serde_json::Value) -> std::result::Result<(), String> {
    match json {
        serde_json::Value::Object(o) => {
            if o.get("type").and_then(|t| t.as_str()) == Some("Precompiled") {
                if let Some(map) = o.get("precompiled_charsmap").and_then(|m| m.as_str()) {
                    let data = map.trim_end_matches('=');
                    let bytes = data.len() * 3 / 4;
                    let head = base64_prefix(data.get(..8.min(data.len())).unwrap_or(""));
                    if let Some(trie) = head.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize) {
                        if trie > bytes.saturating_sub(4) {
                            return Err(format!("a precompiled charsmap declares a trie of {trie} bytes in {bytes} bytes of data"));
                        }
                    }
                }
            }
            o.values().try_for_each(precompiled_charsmaps_hold_their_tries)
        }
        serde_json::Value::Array(a) => a.iter().try_for_each(precompiled_charsmaps_hold_their_tries),
        _ => Ok(()),
    }
}

/// The bytes of a short base64 prefix (padding stripped; a character outside the alphabet ends
/// it).
fn base64_prefix(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' | b'-' => Some(62),
        b'/' | b'_' => Some(63),
        _ => None,
    };
    let (mut out, mut bits, mut held) = (Vec::new(), 0u32, 0u32);
    for v in s.bytes().map_while(value) {
        bits = bits << 6 | v as u32;
        held += 6;
        if held >= 8 {
            held -= 8;
            out.push((bits >> held) as u8);
            bits &= (1 << held) - 1;
        }
    }
    out
}

/// `text`'s ids, without special tokens (a chat template writes its own, as
/// `apply_chat_template` encodes).
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    guarded(|| tok.encode(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())).map_err(Error::Tokenizer)
}

/// `ids` as text, special tokens skipped or not.
pub fn decode(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> std::result::Result<String, String> {
    guarded(|| tok.decode(ids, skip_special).map_err(|e| e.to_string()))
}

/// `f`, a panic in it turned into an error. Encoding and decoding only read the tokenizer (a
/// panic may leave a cache unfilled, not the vocabulary changed); a tokenizer that panicked once
/// may again, and every call is guarded the same way.
fn guarded<T>(f: impl FnOnce() -> std::result::Result<T, String>) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
        Err(format!("the tokenizer panicked: {}", what.unwrap_or_else(|| "no message".into())))
    })
}
