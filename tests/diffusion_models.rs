//! The masked-diffusion families (SDAR, LLaDA, Dream): loading tiny checkpoints in the released
//! layouts, layer-wise forward over the paged cache against a dense reference written here
//! from the raw safetensors, and typed errors for broken checkpoints and configs.

use candle_core::{DType, Device, Tensor, D};
use ponder::config::ModelConfig;
use ponder::diffusion::models::{self, DenseDiffusion, DiffusionModel, Dream, Llada, Sdar};
use ponder::diffusion::DiffusionAttention;
use ponder::kv::KvStore;
use ponder::loader::ModelDir;
use ponder::ops::{AttnMask, PagedBatch, PagedBatchHost};
use ponder::testing::*;
use ponder::Error;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const VOCAB: usize = 101;
/// Two diffusion blocks of 8 tokens.
const TOKENS: usize = 16;
const BLOCK: usize = 8;
/// KV pages of 4 tokens, scattered, so the test also covers the block-table addressing.
const PAGE: usize = 4;
const TABLE: [u32; 4] = [5, 2, 7, 0];

fn tmp_dir(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    (tmp, dir)
}

fn ids() -> Vec<u32> {
    (0..TOKENS as u32).map(|i| (i * 37 + 11) % (VOCAB as u32 - 1)).collect()
}

fn load(dir: &Path) -> DenseDiffusion {
    let md = ModelDir::open(dir).unwrap();
    let w = md.weights(DType::F32, &Device::Cpu).unwrap();
    models::load(&md.config, &w).unwrap()
}

/// Embedding, all layers over the paged cache, head: f32 logits `[TOKENS, vocab]`.
/// `rows` splits the sequence into rows of the launch, each seeing the keys up to its end
/// (one row per block is block-causal attention with the bidirectional mask).
fn paged_logits(m: &DenseDiffusion, rows: &[usize]) -> Tensor {
    let s = m.spec();
    let dev = Device::Cpu;
    let kv = KvStore::new(s.num_layers, 8, PAGE, s.num_kv_heads, s.head_dim, s.dtype, &dev).unwrap();
    let mut host = PagedBatchHost { cu_q_lens: vec![0], ..Default::default() };
    for &end in rows {
        host.block_tables.push(TABLE.to_vec());
        host.context_lens.push(end as u32);
        host.cu_q_lens.push(end as u32);
    }
    let batch = PagedBatch::new(host, PAGE, AttnMask::Bidirectional, s.num_kv_heads * s.head_dim, &dev).unwrap();
    let ids = Tensor::new(ids().as_slice(), &dev).unwrap();
    let pos = Tensor::arange(0u32, TOKENS as u32, &dev).unwrap();
    let h = m.embed(&ids).unwrap();
    let h = m.forward(&h, &m.rope(&pos).unwrap(), &batch, &kv).unwrap();
    m.head(&h).unwrap()
}

/// One family's tensor names for the reference, by role.
struct Names {
    embed: &'static str,
    norm: &'static str,
    head: &'static str,
    layer: fn(usize, &str) -> String,
}

const QWEN: Names = Names {
    embed: "model.embed_tokens.weight",
    norm: "model.norm.weight",
    head: "lm_head.weight",
    layer: |l, role| {
        let n = match role {
            "attn_norm" => "input_layernorm",
            "mlp_norm" => "post_attention_layernorm",
            "q" | "k" | "v" | "o" => return format!("model.layers.{l}.self_attn.{role}_proj"),
            "q_norm" | "k_norm" => return format!("model.layers.{l}.self_attn.{role}"),
            r => return format!("model.layers.{l}.mlp.{r}_proj"),
        };
        format!("model.layers.{l}.{n}")
    },
};

const LLADA: Names = Names {
    embed: "model.transformer.wte.weight",
    norm: "model.transformer.ln_f.weight",
    head: "model.transformer.ff_out.weight",
    layer: |l, role| {
        let n = match role {
            "attn_norm" | "q_norm" | "k_norm" => role,
            "mlp_norm" => "ff_norm",
            "q" | "k" | "v" => return format!("model.transformer.blocks.{l}.{role}_proj"),
            "o" => "attn_out",
            "gate" => "ff_proj",
            "up" => "up_proj",
            "down" => "ff_out",
            r => panic!("{r}"),
        };
        format!("model.transformer.blocks.{l}.{n}")
    },
};

struct Shape {
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    theta: f64,
    eps: f64,
}

fn rms(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    x.broadcast_div(&(ms + eps).unwrap().sqrt().unwrap()).unwrap().broadcast_mul(w).unwrap()
}

/// `x @ w^T (+ b)` for `x: [n, in]`.
fn linear(t: &HashMap<String, Tensor>, x: &Tensor, name: &str) -> Tensor {
    let y = x.matmul(&t[&format!("{name}.weight")].t().unwrap()).unwrap();
    match t.get(&format!("{name}.bias")) {
        Some(b) => y.broadcast_add(b).unwrap(),
        None => y,
    }
}

/// Split-half RoPE of `x: [n, heads, d]` at positions 0..n, written out element by element.
fn rope(x: &Tensor, theta: f64) -> Tensor {
    let (n, heads, d) = x.dims3().unwrap();
    let v = x.to_vec3::<f32>().unwrap();
    let mut out = vec![0f32; n * heads * d];
    for p in 0..n {
        for h in 0..heads {
            for i in 0..d / 2 {
                let a = p as f64 * theta.powf(-2.0 * i as f64 / d as f64);
                let (c, s) = (a.cos() as f32, a.sin() as f32);
                let (x1, x2) = (v[p][h][i], v[p][h][i + d / 2]);
                out[(p * heads + h) * d + i] = x1 * c - x2 * s;
                out[(p * heads + h) * d + i + d / 2] = x2 * c + x1 * s;
            }
        }
    }
    Tensor::from_vec(out, (n, heads, d), &Device::Cpu).unwrap()
}

/// The dense reference: whole-sequence attention with `visible(query, key)`, plain candle ops.
fn reference_logits(t: &HashMap<String, Tensor>, names: &Names, s: &Shape, visible: impl Fn(usize, usize) -> bool) -> Tensor {
    let dev = Device::Cpu;
    let (n, d) = (TOKENS, s.head_dim);
    let ids = Tensor::new(ids().as_slice(), &dev).unwrap();
    let mut x = t[names.embed].index_select(&ids, 0).unwrap();
    let bias: Vec<f32> = (0..n * n).map(|e| if visible(e / n, e % n) { 0.0 } else { f32::NEG_INFINITY }).collect();
    let bias = Tensor::from_vec(bias, (n, n), &dev).unwrap();
    for l in 0..s.layers {
        let name = |role| (names.layer)(l, role);
        let a = rms(&x, &t[&format!("{}.weight", name("attn_norm"))], s.eps);
        let mut q = linear(t, &a, &name("q")).reshape((n, s.heads, d)).unwrap();
        let mut k = linear(t, &a, &name("k")).reshape((n, s.kv_heads, d)).unwrap();
        let v = linear(t, &a, &name("v")).reshape((n, s.kv_heads, d)).unwrap();
        if let (Some(qn), Some(kn)) = (t.get(&format!("{}.weight", name("q_norm"))), t.get(&format!("{}.weight", name("k_norm")))) {
            q = rms(&q, qn, s.eps);
            k = rms(&k, kn, s.eps);
        }
        let (q, k) = (rope(&q, s.theta), rope(&k, s.theta));
        let mut heads = Vec::new();
        for h in 0..s.heads {
            let g = h / (s.heads / s.kv_heads);
            let qh = q.narrow(1, h, 1).unwrap().squeeze(1).unwrap();
            let kh = k.narrow(1, g, 1).unwrap().squeeze(1).unwrap();
            let vh = v.narrow(1, g, 1).unwrap().squeeze(1).unwrap();
            let scores = (qh.matmul(&kh.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
            let p = candle_nn::ops::softmax_last_dim(&(scores + &bias).unwrap()).unwrap();
            heads.push(p.matmul(&vh).unwrap());
        }
        x = (x + linear(t, &Tensor::cat(&heads, 1).unwrap(), &name("o"))).unwrap();
        let m = rms(&x, &t[&format!("{}.weight", name("mlp_norm"))], s.eps);
        let act = (candle_nn::ops::silu(&linear(t, &m, &name("gate"))).unwrap() * linear(t, &m, &name("up"))).unwrap();
        x = (x + linear(t, &act, &name("down"))).unwrap();
    }
    let head = t.get(names.head).unwrap_or(&t[names.embed]);
    rms(&x, &t[names.norm], s.eps).matmul(&head.t().unwrap()).unwrap()
}

fn tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    let d = max_diff(got, want);
    assert!(d < 1e-4, "{what}: max |paged - dense| = {d}");
    let spread: f32 = want.flatten_all().unwrap().var(0).unwrap().to_scalar().unwrap();
    assert!(spread > 1e-4, "{what}: logits too flat ({spread}) for the comparison to mean anything");
}

fn block_causal(q: usize, k: usize) -> bool {
    k / BLOCK <= q / BLOCK
}

#[test]
fn sdar_matches_dense_block_causal_reference() {
    for tied in [false, true] {
        let (_tmp, dir) = tmp_dir("tiny-sdar");
        let cfg = ponder::diffusion::models::SdarConfig { tie_word_embeddings: tied, ..tiny_sdar_config(VOCAB) };
        write_random_sdar(&dir, &cfg, 3).unwrap();
        assert!(matches!(ModelDir::open(&dir).unwrap().config, ModelConfig::Sdar(_)));
        let m = load(&dir);
        let s = m.spec();
        assert_eq!((s.attention, s.shift_logits, s.block_length, s.mask_token_id), (DiffusionAttention::BlockCausal, false, Some(8), 100));
        let shape = Shape { layers: 2, heads: 4, kv_heads: 2, head_dim: 16, theta: cfg.rope_theta, eps: cfg.rms_norm_eps };
        let t = tensors(&dir);
        assert_eq!(t.contains_key("lm_head.weight"), !tied);
        let want = reference_logits(&t, &QWEN, &shape, block_causal);
        // One row per block: block 0 sees keys 0..8, block 1 keys 0..16.
        let got = paged_logits(&m, &[BLOCK, TOKENS]);
        assert_close(&got, &want, &format!("sdar (tied {tied})"));
        // The mask matters: full attention changes block 0's logits.
        let full = reference_logits(&t, &QWEN, &shape, |_, _| true);
        assert!(max_diff(&got.narrow(0, 0, BLOCK).unwrap(), &full.narrow(0, 0, BLOCK).unwrap()) > 1e-3);
    }
}

#[test]
fn llada_matches_dense_bidirectional_reference() {
    let (_tmp, dir) = tmp_dir("tiny-llada");
    let cfg = tiny_llada_config(VOCAB);
    write_random_llada(&dir, &cfg, 4).unwrap();
    assert!(matches!(ModelDir::open(&dir).unwrap().config, ModelConfig::Llada(_)));
    let m = load(&dir);
    assert_eq!((m.spec().attention, m.spec().shift_logits, m.spec().model_type.as_str()), (DiffusionAttention::Bidirectional, false, "llada"));
    let shape = Shape { layers: 2, heads: 4, kv_heads: 2, head_dim: 16, theta: cfg.rope_theta, eps: cfg.rms_norm_eps };
    let want = reference_logits(&tensors(&dir), &LLADA, &shape, |_, _| true);
    assert_close(&paged_logits(&m, &[TOKENS]), &want, "llada");
}

#[test]
fn dream_matches_dense_bidirectional_reference() {
    let (_tmp, dir) = tmp_dir("tiny-dream");
    let cfg = tiny_dream_config(VOCAB);
    write_random_dream(&dir, &cfg, 5).unwrap();
    assert!(matches!(ModelDir::open(&dir).unwrap().config, ModelConfig::Dream(_)));
    let m = load(&dir);
    assert_eq!((m.spec().attention, m.spec().shift_logits, m.spec().mask_token_id), (DiffusionAttention::Bidirectional, true, 100));
    let t = tensors(&dir);
    let bias: f32 = t["model.layers.0.self_attn.k_proj.bias"].abs().unwrap().sum_all().unwrap().to_scalar().unwrap();
    assert!(bias > 0.1, "random biases are non-zero, so the bias path is exercised");
    let shape = Shape { layers: 2, heads: 4, kv_heads: 2, head_dim: 16, theta: cfg.rope_theta, eps: cfg.rms_norm_eps };
    let want = reference_logits(&t, &QWEN, &shape, |_, _| true);
    assert_close(&paged_logits(&m, &[TOKENS]), &want, "dream");
}

#[test]
fn padded_llada_table_is_cut_to_the_vocabulary() {
    let (_tmp, dir) = tmp_dir("tiny-llada-padded");
    let cfg = ponder::diffusion::models::LladaConfig { embedding_size: Some(VOCAB + 11), ..tiny_llada_config(VOCAB) };
    write_random_llada(&dir, &cfg, 6).unwrap();
    let m = load(&dir);
    assert_eq!(paged_logits(&m, &[TOKENS]).dims(), &[TOKENS, VOCAB]);
    assert_eq!(m.spec().head_params, ((VOCAB + 11) * 64) as u64);
}

/// A LLaDA2 config whose layers are all dense (`first_k_dense_replace` covers them, no router
/// groups) passes validation, so it loads: no MoE part is built for it.
#[test]
fn an_all_dense_llada2_loads() {
    let (_tmp, dir) = tmp_dir("tiny-llada2-dense");
    let base = tiny_llada2_config(VOCAB);
    let cfg = ponder::diffusion::models::Llada2Config { first_k_dense_replace: base.num_hidden_layers, n_group: 0, topk_group: 0, ..base };
    write_random_llada2(&dir, &cfg, 9).unwrap();
    let m = load(&dir);
    assert_eq!(paged_logits(&m, &[TOKENS]).dims(), &[TOKENS, VOCAB]);
}

#[test]
fn specs_count_layer_and_head_parameters() {
    let dev = Device::Cpu;
    let in_layers = |m: &[(String, Vec<usize>)], prefix: &str| -> u64 {
        m.iter().filter(|(n, _)| n.starts_with(prefix)).map(|(_, s)| s.iter().product::<usize>() as u64).sum()
    };
    let c = tiny_sdar_config(VOCAB);
    let m = Sdar::load(&c, &random_sdar_weights(&c, 1, DType::F32, &dev).unwrap()).unwrap();
    assert_eq!(m.spec().layer_params, in_layers(&sdar_tensor_manifest(&c), "model.layers."));
    assert_eq!(m.spec().head_params, (VOCAB * 64) as u64);
    let c = tiny_llada_config(VOCAB);
    let m = Llada::load(&c, &random_llada_weights(&c, 1, DType::F32, &dev).unwrap()).unwrap();
    assert_eq!(m.spec().layer_params, in_layers(&llada_tensor_manifest(&c), "model.transformer.blocks."));
    let c = tiny_dream_config(VOCAB);
    let m = Dream::load(&c, &random_dream_weights(&c, 1, DType::F32, &dev).unwrap()).unwrap();
    assert_eq!(m.spec().layer_params, in_layers(&dream_tensor_manifest(&c), "model.layers."));
}

#[test]
fn released_tensor_names_and_shapes() {
    let sdar = sdar_tensor_manifest(&ponder::diffusion::models::SdarConfig::sdar_8b_chat_b32());
    assert_eq!(sdar.len(), 36 * 11 + 3, "399 tensors in JetLM/SDAR-8B-Chat's index");
    assert!(sdar.iter().any(|(n, s)| n == "model.layers.35.self_attn.k_proj.weight" && s == &vec![1024, 4096]));
    assert!(sdar.iter().any(|(n, s)| n == "model.layers.0.self_attn.q_norm.weight" && s == &vec![128]));
    let llada = llada_tensor_manifest(&ponder::diffusion::models::LladaConfig::llada_8b());
    assert_eq!(llada.len(), 32 * 9 + 3);
    assert!(llada.iter().any(|(n, s)| n == "model.transformer.blocks.31.ff_proj.weight" && s == &vec![12288, 4096]));
    assert!(llada.iter().any(|(n, s)| n == "model.transformer.ff_out.weight" && s == &vec![126464, 4096]));
    let dream = dream_tensor_manifest(&ponder::diffusion::models::DreamConfig::dream_7b());
    assert_eq!(dream.len(), 28 * 12 + 3);
    assert!(dream.iter().any(|(n, s)| n == "model.layers.27.self_attn.v_proj.bias" && s == &vec![512]));
    assert!(dream.iter().any(|(n, s)| n == "model.layers.0.mlp.down_proj.weight" && s == &vec![3584, 18944]));
}

/// Rewrites `model.safetensors` with `edit` applied.
fn edit_tensors(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let mut t = tensors(dir);
    edit(&mut t);
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
}

fn load_err(dir: &Path) -> Error {
    let md = ModelDir::open(dir).unwrap();
    let w = md.weights(DType::F32, &Device::Cpu).unwrap();
    models::load(&md.config, &w).expect_err("load must fail")
}

#[test]
fn broken_checkpoints_are_typed_errors() {
    let (_t1, dir) = tmp_dir("dream");
    write_random_dream(&dir, &tiny_dream_config(VOCAB), 7).unwrap();
    edit_tensors(&dir, |t| drop(t.remove("model.layers.1.self_attn.k_proj.bias")));
    assert!(matches!(load_err(&dir), Error::BadTensor { name, .. } if name == "model.layers.1.self_attn.k_proj.bias"));

    let (_t2, dir) = tmp_dir("sdar");
    write_random_sdar(&dir, &tiny_sdar_config(VOCAB), 7).unwrap();
    edit_tensors(&dir, |t| drop(t.insert("model.layers.0.self_attn.q_norm.weight".into(), Tensor::ones(8, DType::F32, &Device::Cpu).unwrap())));
    assert!(matches!(load_err(&dir), Error::BadTensor { name, reason } if name == "model.layers.0.self_attn.q_norm.weight" && reason.contains("shape")));

    // Untied LLaDA without its output matrix; SDAR untied without lm_head.
    let (_t3, dir) = tmp_dir("llada");
    write_random_llada(&dir, &tiny_llada_config(VOCAB), 7).unwrap();
    edit_tensors(&dir, |t| drop(t.remove("model.transformer.ff_out.weight")));
    assert!(matches!(load_err(&dir), Error::BadTensor { name, .. } if name == "model.transformer.ff_out.weight"));
    let (_t4, dir) = tmp_dir("sdar-untied");
    write_random_sdar(&dir, &tiny_sdar_config(VOCAB), 7).unwrap();
    edit_tensors(&dir, |t| drop(t.remove("lm_head.weight")));
    assert!(matches!(load_err(&dir), Error::BadTensor { name, .. } if name == "lm_head.weight"));
}

/// `ModelDir::open` on a directory holding only `config.json` = `cfg` with `edit` applied.
fn open_config(cfg: serde_json::Value, edit: impl FnOnce(&mut serde_json::Value)) -> ponder::Result<ModelDir> {
    let (_tmp, dir) = tmp_dir("cfg");
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = cfg;
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("model.safetensors"), b"").unwrap();
    ModelDir::open(&dir)
}

fn bad_config(r: ponder::Result<ModelDir>, needle: &str) {
    match r {
        Err(Error::BadConfig { reason, .. }) => assert!(reason.contains(needle), "`{reason}` should mention `{needle}`"),
        other => panic!("expected BadConfig about {needle}, got {other:?}"),
    }
}

#[test]
fn bad_configs_are_typed_errors() {
    let sdar = serde_json::to_value(tiny_sdar_config(VOCAB)).unwrap();
    let llada = serde_json::to_value(tiny_llada_config(VOCAB)).unwrap();
    let dream = serde_json::to_value(tiny_dream_config(VOCAB)).unwrap();
    bad_config(open_config(sdar.clone(), |c| c["num_key_value_heads"] = 3.into()), "kv heads");
    bad_config(open_config(llada.clone(), |c| c["n_kv_heads"] = 3.into()), "kv heads");
    bad_config(open_config(dream.clone(), |c| c["num_attention_heads"] = 0.into()), "heads");
    bad_config(open_config(dream.clone(), |c| c["hidden_size"] = 66.into()), "multiple");
    bad_config(open_config(sdar.clone(), |c| c["num_hidden_layers"] = 0.into()), "> 0");
    bad_config(open_config(llada.clone(), |c| c["include_bias"] = true.into()), "include_bias");
    bad_config(open_config(llada.clone(), |c| c["block_type"] = "sequential".into()), "block_type");
    bad_config(open_config(sdar.clone(), |c| c["attention_bias"] = true.into()), "attention_bias");
    bad_config(open_config(dream.clone(), |c| c["hidden_act"] = "gelu".into()), "hidden_act");
    // The mask token: an id past the vocabulary, or the family default for a vocabulary too
    // small to hold it, is the typed "missing mask token" error.
    bad_config(open_config(sdar.clone(), |c| c["mask_token_id"] = VOCAB.into()), "mask token");
    bad_config(open_config(llada.clone(), |c| drop(c.as_object_mut().unwrap().remove("mask_token_id"))), "mask token id 126336");
    bad_config(open_config(dream.clone(), |c| c["mask_token_id"] = serde_json::Value::Null), "mask token id 151666");
    // The released spelling is "Dream"; "dream" is accepted too.
    assert!(matches!(open_config(dream, |c| c["model_type"] = "dream".into()).unwrap().config, ModelConfig::Dream(_)));
}

#[test]
fn constructors_check_the_config_too() {
    let dev = Device::Cpu;
    let good = tiny_sdar_config(VOCAB);
    let w = random_sdar_weights(&good, 1, DType::F32, &dev).unwrap();
    let bad = ponder::diffusion::models::SdarConfig { mask_token_id: Some(VOCAB as u32), ..good };
    assert!(matches!(Sdar::load(&bad, &w), Err(Error::BadConfig { reason, .. }) if reason.contains("mask token")));
    let ouro = ModelConfig::from_json(&serde_json::to_string(&tiny_ouro_config(VOCAB)).unwrap(), "x").unwrap();
    assert!(matches!(models::load(&ouro, &w), Err(Error::UnsupportedModel(_))));
}

#[test]
fn bf16_weights_track_f32() {
    // The released checkpoints are bf16: every op of the layer must take it (norm weights,
    // biases, cache) and stay near the f32 result.
    let (_t1, sdar) = tmp_dir("sdar");
    write_random_sdar(&sdar, &tiny_sdar_config(VOCAB), 8).unwrap();
    let (_t2, dream) = tmp_dir("dream");
    write_random_dream(&dream, &tiny_dream_config(VOCAB), 8).unwrap();
    for (dir, rows) in [(&sdar, &[BLOCK, TOKENS][..]), (&dream, &[TOKENS][..])] {
        let md = ModelDir::open(dir).unwrap();
        let half = models::load(&md.config, &md.weights(DType::BF16, &Device::Cpu).unwrap()).unwrap();
        assert_eq!(half.spec().dtype, DType::BF16);
        let (a, b) = (paged_logits(&half, rows), paged_logits(&load(dir), rows));
        assert_eq!(a.dtype(), DType::F32);
        assert!(max_diff(&a, &b) < 0.05, "{}: bf16 drifts {}", dir.display(), max_diff(&a, &b));
    }
}
