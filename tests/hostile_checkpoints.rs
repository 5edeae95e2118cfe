//! Hostile checkpoint files beyond `tests/mutated_checkpoints.rs`' field-by-field mutations:
//! values the libraries underneath (tokenizers, candle's safetensors, the FP8 scale layouts)
//! accept and then panic, abort, hang or allocate without bound on; files that are not regular
//! files; shards that disagree. Each is a typed `ponder::Error` or a clean serve, never a
//! panic, abort, hang or unbounded allocation. Cases that would abort the process or allocate
//! without bound if they regressed run in a child process (this binary, `--ignored --exact`)
//! under `ulimit -v` and a timeout.

mod common;
use candle_core::{DType, Device, Tensor};
use common::caught;
use ponder::{EngineBuilder, Error, GenerationParams};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------------

fn asset(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets").join(name)
}

/// A copy of the shipped asset `name` in a fresh tempdir.
fn copy_asset(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for f in std::fs::read_dir(asset(name)).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
    (tmp, dst)
}

type Outcome = Result<ponder::Result<()>, String>;

fn build(dir: &Path) -> Outcome {
    caught(|| EngineBuilder::new(dir).max_num_seqs(2).build().map(|_| ()))
}

/// Build and serve one short text request (the tokenizer's encode and decode run).
fn build_and_serve_text(dir: &Path) -> Outcome {
    caught(|| {
        let mut e = EngineBuilder::new(dir).max_num_seqs(2).build()?;
        e.generate(["Ownership and borrowing in Rust"], &GenerationParams::greedy(4)).map(|_| ())
    })
}

fn is_typed(o: &Outcome) -> bool {
    matches!(o, Ok(Err(_)) | Ok(Ok(())))
}

/// Memory cap of a child case (KiB of address space). The chat-template thread reserves 2 GiB
/// of stack, so leave room for it.
const CHILD_VMEM_KB: u64 = 6 * 1024 * 1024;

/// Runs the `#[ignore]`d test `name` of this binary in a child under `ulimit -v` and a timeout:
/// (exit code or None on a signal, the tail of its output).
fn in_child(name: &str, timeout_s: u32) -> (Option<i32>, String) {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {CHILD_VMEM_KB}; exec timeout -s KILL {timeout_s} \"$0\" --exact {name} --ignored --nocapture --test-threads 1"))
        .arg(&exe)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let tail: String = text.lines().rev().take(12).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    #[cfg(unix)]
    let code = {
        use std::os::unix::process::ExitStatusExt;
        out.status.code().or_else(|| out.status.signal().map(|s| -s))
    };
    #[cfg(not(unix))]
    let code = out.status.code();
    (code, tail)
}

fn assert_child_ok(name: &str, timeout_s: u32) {
    let (code, tail) = in_child(name, timeout_s);
    assert_eq!(code, Some(0), "child `{name}` did not end cleanly (code {code:?}; -6 = SIGABRT, -9 = killed by timeout):\n{tail}");
}

/// A change made to a checkpoint directory.
type Mutation = Box<dyn Fn(&Path)>;
/// Shards written from the tiny Ouro's tensors (the directory, the tensors, their names).
type ShardSetup<'a> = dyn Fn(&Path, &HashMap<String, Tensor>, &[String]) + 'a;

/// Peak resident memory of this process so far, KiB.
fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn write_tokenizer(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let p = dir.join("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut t);
    std::fs::write(&p, t.to_string()).unwrap();
}

// ---------------------------------------------------------------------------------------------
// FP8: block sizes beyond the weight
// ---------------------------------------------------------------------------------------------

/// A tiny Ouro re-stored as a fine-grained FP8 release whose projections carry one scale for a
/// `block` tile (the tile larger than the weight: scales `[1, 1]`, which `from_parts` accepts).
fn fp8_release_with_block(dir: &Path, block: u64) {
    ponder::testing::write_random_ouro(dir, &ponder::testing::tiny_ouro_config(common::VOCAB), 1).unwrap();
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut out = HashMap::new();
    for (name, t) in tensors {
        if name.ends_with("_proj.weight") {
            let amax = t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-6);
            let s = amax / 448.0;
            let q = (t / s as f64).unwrap().to_dtype(DType::F8E4M3).unwrap();
            out.insert(format!("{name}_scale_inv"), Tensor::from_vec(vec![s], (1, 1), &Device::Cpu).unwrap());
            out.insert(name, q);
        } else {
            out.insert(name, t);
        }
    }
    candle_core::safetensors::save(&out, dir.join("model.safetensors")).unwrap();
    let p = dir.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    c["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]});
    std::fs::write(&p, c.to_string()).unwrap();
}

/// Sanity: a tile of 128 (larger than the tiny weights, as real releases would be for small
/// layers) builds and serves.
#[test]
fn fp8_block_128_larger_than_weight_builds() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    fp8_release_with_block(&dir, 128);
    let o = caught(|| {
        let mut e = EngineBuilder::new(&dir).max_num_seqs(2).build()?;
        e.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(2)).map(|_| ())
    });
    assert!(matches!(o, Ok(Ok(()))), "{o:?}");
}

/// weight_block_size [u64::MAX, u64::MAX]: refused by `CheckpointQuant::from_config` (blocks
/// are at most `MAX_DIM`; the CUDA kernels take them as 32-bit integers).
#[test]
fn fp8_weight_block_size_u64_max_is_typed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    fp8_release_with_block(&dir, u64::MAX);
    let o = build(&dir);
    assert!(is_typed(&o), "panicked: {o:?}");
    assert!(matches!(o, Ok(Err(_))), "a block of u64::MAX must be refused: {o:?}");
}

/// weight_block_size [2^20, 2^20] on 64-wide weights: dequantizing picks each weight's tile
/// scale, no larger than the weight (a broadcast of whole tiles would be 2^20 × 2^20 f32, 4 TiB).
#[test]
#[ignore = "run in a child by fp8_huge_block_is_bounded"]
fn child_fp8_huge_block() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    fp8_release_with_block(&dir, 1 << 20);
    let o = caught(|| {
        let mut e = EngineBuilder::new(&dir).max_num_seqs(2).build()?;
        e.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(2)).map(|_| ())
    });
    println!("outcome: {o:?}");
    assert!(is_typed(&o), "panicked: {o:?}");
}

#[test]
fn fp8_huge_block_is_bounded() {
    assert_child_ok("child_fp8_huge_block", 120);
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json: values the tokenizers crate accepts at load and panics or aborts on later
// ---------------------------------------------------------------------------------------------

/// `truncation` with stride >= max_length: the tokenizers crate accepts it at load and asserts
/// `stride < max_len` on every longer encode; the engine switches truncation off.
#[test]
fn tokenizer_truncation_stride_ge_max_length() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    write_tokenizer(&dir, |t| t["truncation"] = json!({"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 2}));
    let built = build(&dir);
    println!("build: {built:?}");
    let o = build_and_serve_text(&dir);
    assert!(is_typed(&o), "panicked: {o:?}");
}

/// A `Precompiled` normalizer whose charsmap holds an empty trie ("AAAAAA==": trie size 0):
/// it loads, then indexes `array[0]` of the empty trie on every encode; the load-time probe
/// finds that.
#[test]
fn tokenizer_precompiled_empty_trie() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    write_tokenizer(&dir, |t| t["normalizer"] = json!({"type": "Precompiled", "precompiled_charsmap": "AAAAAA=="}));
    let built = build(&dir);
    println!("build: {built:?}");
    let o = build_and_serve_text(&dir);
    assert!(is_typed(&o), "panicked: {o:?}");
}

/// A `Strip` decoder whose `stop` exceeds a token made only of its `content` char
/// (`Replace` turns every token into "a" first): tokenizers' Strip computes `len - i - 1`
/// below zero when a token is decoded; the probe or the guarded decode finds that.
#[test]
fn tokenizer_strip_decoder_past_token() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    write_tokenizer(&dir, |t| {
        t["decoder"] = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"Regex": "(?s).+"}, "content": "a"},
            {"type": "Strip", "content": "a", "start": 0, "stop": 4}
        ]})
    });
    let built = build(&dir);
    println!("build: {built:?}");
    let o = build_and_serve_text(&dir);
    assert!(is_typed(&o), "panicked: {o:?}");
}

/// `padding` Fixed to u64::MAX: accepted at load, and encoding would pad every prompt to that
/// length (a capacity overflow); the engine switches padding off.
#[test]
#[ignore = "run in a child by tokenizer_padding_is_bounded"]
fn child_tokenizer_padding_u64_max() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    write_tokenizer(&dir, |t| {
        t["padding"] =
            json!({"strategy": {"Fixed": u64::MAX}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"})
    });
    let o = build_and_serve_text(&dir);
    println!("outcome: {o:?}");
    assert!(is_typed(&o), "panicked: {o:?}");
}

/// `padding` Fixed to 2^40: encoding would ask for 4 TiB of ids (an allocation abort).
#[test]
#[ignore = "run in a child by tokenizer_padding_is_bounded"]
fn child_tokenizer_padding_2_pow_40() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    write_tokenizer(&dir, |t| {
        t["padding"] =
            json!({"strategy": {"Fixed": 1u64 << 40}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"})
    });
    let o = build_and_serve_text(&dir);
    println!("outcome: {o:?}");
    assert!(is_typed(&o), "panicked: {o:?}");
}

#[test]
fn tokenizer_padding_is_bounded() {
    let a = in_child("child_tokenizer_padding_u64_max", 120);
    let b = in_child("child_tokenizer_padding_2_pow_40", 120);
    assert!(a.0 == Some(0) && b.0 == Some(0), "u64::MAX: {a:?}\n2^40: {b:?}");
}

/// A `Precompiled` charsmap declaring a trie of u32::MAX bytes ("/////w=="): the tokenizers
/// crate would reserve `trie_size / 4` usizes (8 GiB) before reading any; refused first.
#[test]
#[ignore = "run in a child by tokenizer_precompiled_huge_trie_is_bounded"]
fn child_tokenizer_precompiled_huge_trie() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    write_tokenizer(&dir, |t| t["normalizer"] = json!({"type": "Precompiled", "precompiled_charsmap": "/////w=="}));
    let o = build(&dir);
    println!("outcome: {o:?}");
    assert!(is_typed(&o), "panicked: {o:?}");
}

#[test]
fn tokenizer_precompiled_huge_trie_is_bounded() {
    assert_child_ok("child_tokenizer_precompiled_huge_trie", 120);
}

/// Other tokenizer.json damage: typed errors (or a clean serve).
#[test]
fn tokenizer_json_damage_is_typed() {
    let cases: Vec<(&str, Mutation)> = vec![
        ("empty", Box::new(|d: &Path| std::fs::write(d.join("tokenizer.json"), "").unwrap())),
        ("not json", Box::new(|d: &Path| std::fs::write(d.join("tokenizer.json"), "{{{").unwrap())),
        ("null", Box::new(|d: &Path| std::fs::write(d.join("tokenizer.json"), "null").unwrap())),
        ("model removed", Box::new(|d: &Path| write_tokenizer(d, |t| drop(t.as_object_mut().unwrap().remove("model"))))),
        ("vocab empty", Box::new(|d: &Path| write_tokenizer(d, |t| t["model"]["vocab"] = json!({})))),
        ("merges empty", Box::new(|d: &Path| write_tokenizer(d, |t| t["model"]["merges"] = json!([])))),
        ("added token id u32::MAX", Box::new(|d: &Path| write_tokenizer(d, |t| t["added_tokens"][0]["id"] = json!(u32::MAX)))),
        (
            "bad split regex",
            Box::new(|d: &Path| {
                write_tokenizer(d, |t| t["pre_tokenizer"] = json!({"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated", "invert": false}))
            }),
        ),
        (
            "truncation max_length 0",
            Box::new(|d: &Path| {
                write_tokenizer(d, |t| t["truncation"] = json!({"direction": "Right", "max_length": 0, "strategy": "LongestFirst", "stride": 0}))
            }),
        ),
        (
            "wordpiece no unk",
            Box::new(|d: &Path| {
                write_tokenizer(d, |t| {
                    t["model"] = json!({"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100})
                })
            }),
        ),
        ("unigram empty", Box::new(|d: &Path| write_tokenizer(d, |t| t["model"] = json!({"type": "Unigram", "unk_id": null, "vocab": []})))),
        ("unigram unk out of range", Box::new(|d: &Path| write_tokenizer(d, |t| t["model"] = json!({"type": "Unigram", "unk_id": 5, "vocab": [["a", -1.0]]})))),
        (
            "a directory",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("tokenizer.json")).unwrap();
                std::fs::create_dir(d.join("tokenizer.json")).unwrap();
            }),
        ),
    ];
    let mut bad = Vec::new();
    for (label, mutate) in cases {
        let (_tmp, dir) = copy_asset("tiny-ouro");
        mutate(&dir);
        let o = build_and_serve_text(&dir);
        println!("{label}: {o:?}");
        if !is_typed(&o) {
            bad.push(format!("{label}: {o:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// A tokenizer whose added token has an id far past the model's vocabulary: a prompt holding it
/// is a typed request error, not an out-of-range embedding lookup.
#[test]
fn tokenizer_ids_beyond_model_vocab_are_typed() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    write_tokenizer(&dir, |t| {
        t["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(json!({"id": 1000000, "content": "<big>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}));
    });
    let o = caught(|| {
        let mut e = EngineBuilder::new(&dir).max_num_seqs(2).build()?;
        let outs = e.generate(["hello <big> world"], &GenerationParams::greedy(2))?;
        println!("{outs:?}");
        Ok::<_, Error>(())
    });
    assert!(is_typed(&o), "panicked: {o:?}");
}

// ---------------------------------------------------------------------------------------------
// files that are not regular files
// ---------------------------------------------------------------------------------------------

/// The tiny Ouro with `file` a symlink to `/dev/zero`: a typed error, having read little of it.
#[cfg(unix)]
fn dev_zero_as(file: &str) {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    std::fs::remove_file(dir.join(file)).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join(file)).unwrap();
    let o = build(&dir);
    println!("outcome: {o:?}");
    assert!(matches!(o, Ok(Err(_))), "{file} -> /dev/zero: {o:?}");
    let peak = peak_rss_kb();
    assert!(peak < 1 << 20, "reading it took {peak} KiB resident before failing ({o:?})");
}

#[cfg(unix)]
#[test]
#[ignore = "run in a child by dev_zero_files_are_bounded"]
fn child_config_symlink_to_dev_zero() {
    dev_zero_as("config.json");
}

#[cfg(unix)]
#[test]
#[ignore = "run in a child by dev_zero_files_are_bounded"]
fn child_tokenizer_symlink_to_dev_zero() {
    dev_zero_as("tokenizer.json");
}

#[cfg(unix)]
#[test]
fn dev_zero_files_are_bounded() {
    assert_child_ok("child_config_symlink_to_dev_zero", 60);
    assert_child_ok("child_tokenizer_symlink_to_dev_zero", 60);
}

/// config.json as a FIFO nobody writes: opening it would block forever; it is not a regular
/// file and is refused before.
#[cfg(unix)]
#[test]
fn config_fifo_does_not_hang() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    let cfg = dir.join("config.json");
    std::fs::remove_file(&cfg).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(&cfg).status().unwrap().success());
    let d = dir.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(build(&d));
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(5));
    if got.is_err() {
        // Unblock the loader (open for writing, write garbage, close) so the thread ends.
        std::fs::write(&cfg, "{").unwrap();
        let after = rx.recv_timeout(std::time::Duration::from_secs(10));
        panic!("build blocked > 5 s on a FIFO config.json (after unblocking: {after:?})");
    }
}

#[cfg(unix)]
#[test]
fn weird_paths_are_typed() {
    let mut bad = Vec::new();
    let mut check = |label: &str, dir: &Path| {
        let o = build(dir);
        println!("{label}: {o:?}");
        if !matches!(o, Ok(Err(_))) {
            bad.push(format!("{label}: {o:?}"));
        }
    };
    let (tmp, dir) = copy_asset("tiny-ouro");
    check("dir is a file", &dir.join("config.json"));
    check("missing dir", &tmp.path().join("nope"));
    let loop_dir = tmp.path().join("loop");
    std::os::unix::fs::symlink(&loop_dir, &loop_dir).unwrap();
    check("dir is a symlink loop", &loop_dir);
    let (_t2, d2) = copy_asset("tiny-ouro");
    std::fs::remove_file(d2.join("config.json")).unwrap();
    std::os::unix::fs::symlink(d2.join("config.json"), d2.join("config.json")).unwrap();
    check("config.json symlink loop", &d2);
    let (_t3, d3) = copy_asset("tiny-ouro");
    std::fs::remove_file(d3.join("config.json")).unwrap();
    std::fs::create_dir(d3.join("config.json")).unwrap();
    check("config.json is a directory", &d3);
    let (_t4, d4) = copy_asset("tiny-ouro");
    std::fs::remove_file(d4.join("model.safetensors")).unwrap();
    std::fs::create_dir(d4.join("model.safetensors")).unwrap();
    check("model.safetensors is a directory", &d4);
    let (_t5, d5) = copy_asset("tiny-ouro");
    std::fs::remove_file(d5.join("model.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", d5.join("model.safetensors")).unwrap();
    check("model.safetensors -> /dev/zero", &d5);
    let (_t6, d6) = copy_asset("tiny-ouro");
    std::fs::remove_file(d6.join("tokenizer_config.json")).unwrap();
    std::fs::create_dir(d6.join("tokenizer_config.json")).unwrap();
    check("tokenizer_config.json is a directory", &d6);
    let (_t7, d7) = copy_asset("tiny-ouro");
    std::fs::remove_file(d7.join("generation_config.json")).unwrap();
    std::fs::create_dir(d7.join("generation_config.json")).unwrap();
    check("generation_config.json is a directory", &d7);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// safetensors headers and shards
// ---------------------------------------------------------------------------------------------

/// (header JSON, data) of a safetensors file.
fn split_st(bytes: &[u8]) -> (serde_json::Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header.as_object().unwrap().clone(), bytes[8 + n..].to_vec())
}

fn join_st(header_text: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header_text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header_text.as_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn safetensors_header_damage_is_typed() {
    let original = std::fs::read(asset("tiny-ouro").join("model.safetensors")).unwrap();
    let (header, data) = split_st(&original);
    let mut names: Vec<String> = header.keys().filter(|k| *k != "__metadata__").cloned().collect();
    names.sort_by_key(|k| header[k]["data_offsets"][0].as_u64().unwrap());
    let (first, second) = (names[0].clone(), names[1].clone());
    let with = |edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut h = header.clone();
        edit(&mut h);
        join_st(&Value::Object(h).to_string(), &data)
    };
    let mut cases: Vec<(String, Vec<u8>)> = vec![
        ("empty file".into(), vec![]),
        ("8 bytes".into(), vec![0; 8]),
        ("header len u64::MAX".into(), {
            let mut b = original.clone();
            b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
            b
        }),
        ("header len past the file".into(), {
            let mut b = original.clone();
            b[..8].copy_from_slice(&(original.len() as u64).to_le_bytes());
            b
        }),
        ("header not json".into(), join_st("not json at all", &data)),
        ("header an array".into(), join_st("[]", &data)),
        ("header not utf8".into(), {
            let mut b = (4u64).to_le_bytes().to_vec();
            b.extend_from_slice(&[0xff, 0xfe, 0xfd, 0xfc]);
            b
        }),
    ];
    let f = first.clone();
    cases.push(("offsets past the end".into(), with(&|h| h[&f]["data_offsets"] = json!([0, data.len() as u64 + 4096]))));
    let (f, s) = (first.clone(), second.clone());
    cases.push((
        "overlapping offsets".into(),
        with(&|h| {
            let o = h[&f]["data_offsets"].clone();
            h[&s]["data_offsets"] = o;
        }),
    ));
    let f = first.clone();
    cases.push(("dtype changed BF16 -> F32 (size mismatch)".into(), with(&|h| h[&f]["dtype"] = json!("F32"))));
    cases.push(("dtype unknown".into(), with(&|h| h[&f]["dtype"] = json!("F128"))));
    cases.push(("dtype F4".into(), with(&|h| h[&f]["dtype"] = json!("F4"))));
    cases.push(("dtype BOOL".into(), with(&|h| h[&f]["dtype"] = json!("BOOL"))));
    cases.push(("shape product overflows".into(), with(&|h| h[&f]["shape"] = json!([1u64 << 32, 1u64 << 32, 1u64 << 32]))));
    cases.push(("shape u64::MAX x 0".into(), with(&|h| h[&f]["shape"] = json!([u64::MAX, 0]))));
    cases.push(("negative offsets".into(), with(&|h| h[&f]["data_offsets"] = json!([-1, 4]))));
    cases.push(("start > end".into(), with(&|h| h[&f]["data_offsets"] = json!([8, 4]))));
    cases.push(("offsets u64::MAX".into(), with(&|h| h[&f]["data_offsets"] = json!([u64::MAX, u64::MAX]))));
    cases.push(("metadata not strings".into(), with(&|h| drop(h.insert("__metadata__".into(), json!({"a": 1}))))));
    cases.push(("tensor entry a string".into(), with(&|h| drop(h.insert(f.clone(), json!("x"))))));
    let mut bad = Vec::new();
    for (label, bytes) in cases {
        let (_tmp, dir) = copy_asset("tiny-ouro");
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        let o = build(&dir);
        println!("{label}: {:?}", o.as_ref().map(|r| r.as_ref().err().map(|e| e.to_string())));
        if !matches!(o, Ok(Err(_))) {
            bad.push(format!("{label}: {o:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Shards of the tiny Ouro: (dir, tensors, the names in order).
fn sharded(tmp: &Path) -> (PathBuf, HashMap<String, Tensor>, Vec<String>) {
    let src = asset("tiny-ouro");
    let dir = tmp.join("sharded");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let tensors = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<String> = tensors.keys().cloned().collect();
    names.sort();
    (dir, tensors, names)
}

fn write_shards(dir: &Path, tensors: &HashMap<String, Tensor>, shards: &[(&str, Vec<String>)], index: Value) {
    for (file, names) in shards {
        let part: HashMap<_, _> = names.iter().map(|n| (n.clone(), tensors[n].clone())).collect();
        candle_core::safetensors::save(&part, dir.join(file)).unwrap();
    }
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn sharded_index_damage_is_typed() {
    let mut bad = Vec::new();
    let mut run = |label: &str, setup: &ShardSetup<'_>, want_err: bool| {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, tensors, names) = sharded(tmp.path());
        setup(&dir, &tensors, &names);
        let o = build(&dir);
        println!("{label}: {:?}", o.as_ref().map(|r| r.as_ref().err().map(|e| e.to_string())));
        let ok = if want_err { matches!(o, Ok(Err(_))) } else { is_typed(&o) };
        if !ok {
            bad.push(format!("{label}: {o:?}"));
        }
    };
    let half = |names: &[String]| names.len() / 2;
    let map_of = |a: &[String], fa: &str, b: &[String], fb: &str| {
        let mut m = serde_json::Map::new();
        for n in a {
            m.insert(n.clone(), fa.into());
        }
        for n in b {
            m.insert(n.clone(), fb.into());
        }
        json!({"metadata": {}, "weight_map": m})
    };
    run(
        "index names a missing shard",
        &|d, t, n| {
            let (a, b) = n.split_at(half(n));
            write_shards(d, t, &[("s1.safetensors", a.to_vec())], map_of(a, "s1.safetensors", b, "s2.safetensors"));
        },
        true,
    );
    run("empty weight_map", &|d, t, n| write_shards(d, t, &[("s1.safetensors", n.to_vec())], json!({"weight_map": {}})), true);
    run("weight_map not an object", &|d, t, n| write_shards(d, t, &[("s1.safetensors", n.to_vec())], json!({"weight_map": [1, 2]})), true);
    run(
        "index not json",
        &|d, t, n| {
            write_shards(d, t, &[("s1.safetensors", n.to_vec())], json!({}));
            std::fs::write(d.join("model.safetensors.index.json"), "{").unwrap();
        },
        true,
    );
    run("shard is the directory itself (\"\")", &|d, t, n| write_shards(d, t, &[("s1.safetensors", n.to_vec())], map_of(n, "", &[], "")), true);
    run("shard is /dev/zero", &|d, t, n| write_shards(d, t, &[("s1.safetensors", n.to_vec())], map_of(n, "/dev/zero", &[], "")), true);
    run(
        "shard outside the dir (../)",
        &|d, t, n| {
            write_shards(d, t, &[("s1.safetensors", n.to_vec())], map_of(n, "../outside.safetensors", &[], ""));
            std::fs::rename(d.join("s1.safetensors"), d.parent().unwrap().join("outside.safetensors")).unwrap();
        },
        false,
    );
    // The same tensor in two shards with different values: which one is read is silent.
    run(
        "duplicate tensor across shards",
        &|d, t, n| {
            let (a, b) = n.split_at(half(n));
            let mut b2 = b.to_vec();
            b2.push(a[0].clone());
            write_shards(d, t, &[("s1.safetensors", a.to_vec())], map_of(a, "s1.safetensors", b, "s2.safetensors"));
            let mut part: HashMap<_, _> = b.iter().map(|x| (x.clone(), t[x].clone())).collect();
            part.insert(a[0].clone(), (t[&a[0]].zeros_like().unwrap() + 7.0).unwrap());
            candle_core::safetensors::save(&part, d.join("s2.safetensors")).unwrap();
        },
        true,
    );
    run(
        "tensor listed in the wrong shard",
        &|d, t, n| {
            let (a, b) = n.split_at(half(n));
            write_shards(d, t, &[("s1.safetensors", a.to_vec()), ("s2.safetensors", b.to_vec())], {
                let mut idx = map_of(a, "s1.safetensors", b, "s2.safetensors");
                idx["weight_map"][&a[0]] = "s2.safetensors".into();
                idx
            });
        },
        false,
    );
    run(
        "an extra shard with unknown tensors",
        &|d, t, n| {
            write_shards(d, t, &[("s1.safetensors", n.to_vec())], map_of(n, "s1.safetensors", &["junk".to_string()], "s2.safetensors"));
            let junk: HashMap<String, Tensor> = HashMap::from([("junk".to_string(), Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap())]);
            candle_core::safetensors::save(&junk, d.join("s2.safetensors")).unwrap();
        },
        false,
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// config combinations (single-field mutations are covered by tests/mutated_checkpoints.rs)
// ---------------------------------------------------------------------------------------------

#[test]
fn config_combinations_are_typed() {
    let edits: Vec<(&str, &str, Value)> = vec![
        ("tiny-ouro", "head_dim odd with hidden divisible", json!({"head_dim": 63})),
        ("tiny-ouro", "head_dim explicit 2^20", json!({"head_dim": 1 << 20})),
        ("tiny-ouro", "kv heads > heads", json!({"num_key_value_heads": 8})),
        ("tiny-ouro", "heads not dividing hidden, no head_dim", json!({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": null})),
        ("tiny-ouro", "rope_theta 1e308", json!({"rope_theta": 1e308})),
        ("tiny-ouro", "rope_theta 5e-324", json!({"rope_theta": 5e-324})),
        ("tiny-ouro", "rms_norm_eps 1e308", json!({"rms_norm_eps": 1e308})),
        ("tiny-ouro", "eos list of 100k ids", json!({"eos_token_id": (0..100_000u32).collect::<Vec<_>>()})),
        ("tiny-ouro", "eos u32::MAX", json!({"eos_token_id": u32::MAX})),
        ("tiny-ouro", "vocab_size larger than the embedding", json!({"vocab_size": 8192})),
        ("tiny-ouro", "quantization_config a string", json!({"quantization_config": "fp8"})),
        ("tiny-ouro", "fp8 block [1,1] on a dense checkpoint", json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 1]}})),
        (
            "tiny-ouro",
            "compressed-tensors huge block_structure on dense",
            json!({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [u64::MAX, u64::MAX]}}}}}),
        ),
        (
            "tiny-ouro",
            "config_groups with 10k groups",
            json!({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": (0..10_000).map(|i| (format!("g{i}"), json!({"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}))).collect::<serde_json::Map<_, _>>()}}),
        ),
        ("tiny-sdar", "block_size 2^24", json!({"block_size": 1 << 24})),
        ("tiny-sdar", "rope_scaling object", json!({"rope_scaling": {"type": "yarn", "factor": 4.0}})),
        ("tiny-sdar", "MoE fields on a dense checkpoint", json!({"num_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 64})),
        ("tiny-sdar", "MoE top_k == experts", json!({"num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 64})),
        ("tiny-sdar", "mlp_only_layers huge", json!({"mlp_only_layers": [u64::MAX, 0]})),
        ("tiny-sdar", "mask id = vocab - 1 and eos = mask", json!({"mask_token_id": 4095, "eos_token_id": 4095})),
        ("tiny-llada", "embedding_size < vocab", json!({"embedding_size": 16})),
        ("tiny-llada", "n_kv_heads 0", json!({"n_kv_heads": 0})),
        ("tiny-llada", "d_model not multiple of heads", json!({"n_heads": 7})),
    ];
    let mut bad = Vec::new();
    for (asset_name, label, patch) in edits {
        let (_tmp, dir) = copy_asset(asset_name);
        let p = dir.join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for (k, v) in patch.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(&p, c.to_string()).unwrap();
        let o = caught(|| {
            let mut e = EngineBuilder::new(&dir).max_num_seqs(2).build()?;
            e.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(2)).map(|_| ())
        });
        println!("{asset_name} {label}: {:?}", o.as_ref().map(|r| r.as_ref().err().map(|e| e.to_string())));
        if !is_typed(&o) {
            bad.push(format!("{asset_name} {label}: {o:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Context windows at the bound (2^24) for every family: building and a short generation keep
/// peak memory bounded (nothing sized per position of the window at load).
#[test]
#[ignore = "run in a child by max_context_windows_are_bounded"]
fn child_max_context_windows() {
    let tmp = tempfile::tempdir().unwrap();
    let mut report = Vec::new();
    for (family, dir) in common::family_checkpoints(tmp.path()) {
        let p = dir.join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for f in ["max_position_embeddings", "max_sequence_length", "block_size"] {
            if c.get(f).is_some_and(|v| v.as_u64().is_some_and(|n| n > 64)) {
                c[f] = json!(1u64 << 24);
            }
        }
        std::fs::write(&p, c.to_string()).unwrap();
        let o = caught(|| {
            let mut e = EngineBuilder::new(&dir).max_num_seqs(2).build()?;
            e.generate([vec![1u32, 2, 3]], &GenerationParams::greedy(2)).map(|_| ())
        });
        let hwm = std::fs::read_to_string("/proc/self/status").unwrap().lines().find(|l| l.starts_with("VmHWM")).unwrap_or("").to_string();
        report.push(format!("{family}: {:?} {hwm}", o.as_ref().map(|r| r.as_ref().err().map(|e| e.to_string()))));
        assert!(is_typed(&o), "{family}: panicked: {o:?}");
    }
    println!("{}", report.join("\n"));
}

#[test]
fn max_context_windows_are_bounded() {
    assert_child_ok("child_max_context_windows", 300);
}

// ---------------------------------------------------------------------------------------------
// the same tokenizer.json panics through `EngineBuilder::spawn` / `EngineHandle`
// ---------------------------------------------------------------------------------------------

/// The same tokenizers through the handle: a typed error from `spawn` or `submit`, or a served
/// request; never a panic on the caller's thread or the engine thread.
#[test]
fn tokenizer_panics_through_the_handle() {
    let mut bad = Vec::new();
    let cases: Vec<(&str, Value)> = vec![
        ("truncation", json!({"truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 2}})),
        ("precompiled", json!({"normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAAAA=="}})),
        (
            "strip",
            json!({"decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"Regex": "(?s).+"}, "content": "a"},
                {"type": "Strip", "content": "a", "start": 0, "stop": 4}]}}),
        ),
    ];
    for (label, patch) in cases {
        let (_tmp, dir) = copy_asset("tiny-ouro");
        write_tokenizer(&dir, |t| {
            for (k, v) in patch.as_object().unwrap() {
                t[k] = v.clone();
            }
        });
        let o = caught(|| {
            let h = EngineBuilder::new(&dir).max_num_seqs(2).spawn()?;
            let stream = h.submit("Ownership and borrowing in Rust", GenerationParams::greedy(4))?;
            let events: Vec<_> = stream.collect();
            let last = events.last().map(|e| format!("{e:?}"));
            let after = h.submit("again", GenerationParams::greedy(1)).map(|_| ());
            Ok::<_, Error>((events.len(), last, after.err().map(|e| e.to_string())))
        });
        println!("{label}: {o:?}");
        if o.is_err() {
            bad.push(format!("{label}: {o:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// tokenizer.json `padding` / `truncation` (left on by many saved training tokenizers) would
/// rewrite every text prompt (Fixed(16) padding turns "hi" into 16 ids): switched off.
#[test]
fn tokenizer_padding_silently_changes_prompts() {
    let (_tmp, dir) = copy_asset("tiny-ouro");
    let plain = EngineBuilder::new(&dir).max_num_seqs(1).build().unwrap().encode("hi").unwrap();
    write_tokenizer(&dir, |t| {
        t["padding"] = json!({"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"})
    });
    let padded = EngineBuilder::new(&dir).max_num_seqs(1).build().unwrap().encode("hi").unwrap();
    println!("plain {plain:?} padded {padded:?}");
    assert_eq!(plain, padded, "the checkpoint's padding rewrote the prompt");
}
