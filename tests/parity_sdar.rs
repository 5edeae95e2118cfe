//! Parity with an independent PyTorch implementation (tools/reference/sdar_ref.py, float64):
//! the shipped tiny SDAR's logits at the masked positions of a prompt's first decode block,
//! computed by Ponder in f32 on the CPU through the paged block-causal path (the prompt's full
//! blocks prefilled in the same launch as the decode block, as the engine runs it), match within
//! 1e-5 relative; and greedy block-diffusion decodes through the engine (two blocks and more,
//! threshold and static policies) equal the reference's loop (`block_diffusion_ref.py`) token for
//! token.

mod common;
use candle_core::Tensor;
use common::{fixture_params, fixture_policy};
use ponder::diffusion::models::{self, DiffusionModel};
use ponder::kv::KvManager;
use ponder::loader::ModelDir;
use ponder::ops::{AttnMask, PagedBatch, PagedBatchHost};
use ponder::{DType, Device, RequestId};

#[derive(serde::Deserialize)]
struct Fixture {
    block_size: usize,
    mask_token_id: u32,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    decode_block: [usize; 2],
    masked_positions: Vec<usize>,
    top5: Vec<Top5>,
    full_logits: Vec<Full>,
}

#[derive(serde::Deserialize)]
struct Top5 {
    position: usize,
    ids: Vec<u32>,
    logits: Vec<f64>,
}

#[derive(serde::Deserialize)]
struct Full {
    position: usize,
    logits: Vec<f64>,
}

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum::<f64>().sqrt();
    num / b.iter().map(|y| y * y).sum::<f64>().sqrt()
}

#[test]
fn tiny_sdar_matches_the_pytorch_reference() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/tiny_sdar_reference.json")).unwrap()).unwrap();
    let dir = ModelDir::open(root.join("assets/tiny-sdar")).unwrap();
    let tok = dir.tokenizer().unwrap().unwrap();
    let model = models::load(&dir.config, &dir.weights(DType::F32, &Device::Cpu).unwrap()).unwrap();
    let spec = model.spec().clone();
    assert_eq!((spec.block_length, spec.mask_token_id), (Some(fx.block_size), fx.mask_token_id));
    let b = fx.block_size;
    let mut kv_mgr = KvManager::new(64, 16, 1);
    let kv = ponder::kv::KvStore::new(spec.num_layers, 64, 16, spec.num_kv_heads, spec.head_dim, DType::F32, &Device::Cpu).unwrap();
    let mut host = PagedBatchHost { cu_q_lens: vec![0], ..Default::default() };
    let (mut ids, mut positions, mut readout, mut expected) = (vec![], vec![], vec![], vec![]);
    for (i, c) in fx.cases.iter().enumerate() {
        assert_eq!(tok.encode(c.text.as_str(), false).unwrap().get_ids(), c.prompt_ids.as_slice(), "{}", c.text);
        let [start, end] = c.decode_block;
        assert_eq!(start, c.prompt_ids.len() / b * b);
        let id = RequestId(i as u64);
        assert!(kv_mgr.reserve(id, end));
        let table = kv_mgr.tables(id).unwrap()[0].to_vec();
        // Two rows per request, as the engine issues them: the prompt's full blocks, then the
        // decode block (block-causal: it sees them, they do not see it).
        for (lo, hi) in [(0, start), (start, end)] {
            if lo == hi {
                continue;
            }
            let base = ids.len();
            ids.extend_from_slice(&c.ids[lo..hi]);
            positions.extend((lo..hi).map(|p| p as u32));
            host.block_tables.push(table.clone());
            host.context_lens.push(hi as u32);
            host.cu_q_lens.push(ids.len() as u32);
            if lo == start {
                for &p in &c.masked_positions {
                    assert_eq!(c.ids[p], fx.mask_token_id);
                    readout.push((base + p - start) as u32);
                    expected.push((i, p));
                }
            }
        }
    }
    host.write_positions = positions.clone();
    let dev = Device::Cpu;
    let batch = PagedBatch::new(host, 16, AttnMask::BlockCausal(b), spec.num_kv_heads * spec.head_dim, &dev).unwrap();
    let h = model.embed(&Tensor::new(ids.as_slice(), &dev).unwrap()).unwrap();
    let rope = model.rope(&Tensor::new(positions.as_slice(), &dev).unwrap()).unwrap();
    let h = model.forward(&h, &rope, &batch, &kv).unwrap();
    let logits = model.head(&h.index_select(&Tensor::new(readout.as_slice(), &dev).unwrap(), 0).unwrap()).unwrap().to_vec2::<f32>().unwrap();
    let (mut checked_top, mut checked_full) = (0, 0);
    for (row, &(i, p)) in logits.iter().zip(&expected) {
        let c = &fx.cases[i];
        let top = c.top5.iter().find(|t| t.position == p).expect("fixture has top-5 for every masked position");
        let ours: Vec<f32> = top.ids.iter().map(|&t| row[t as usize]).collect();
        let err = rel_err(&ours, &top.logits);
        assert!(err <= 1e-5, "{} position {p}: top-5 logits rel err {err:e}", c.text);
        let argmax = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        assert_eq!(argmax, top.ids[0], "{} position {p}: argmax", c.text);
        checked_top += 1;
        if let Some(full) = c.full_logits.iter().find(|f| f.position == p) {
            let err = rel_err(row, &full.logits);
            assert!(err <= 1e-5, "{} position {p}: full logits rel err {err:e}", c.text);
            checked_full += 1;
        }
    }
    assert!(checked_top >= 12 && checked_full >= 2 * fx.cases.len(), "{checked_top} top-5 rows, {checked_full} full rows");
}

#[test]
fn block_diffusion_decodes_match_the_float64_reference() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/tiny_sdar_reference.json")).unwrap()).unwrap();
    let cases = doc["generate"].as_array().unwrap();
    assert!(cases.len() >= 10, "the fixture has {} decodes", cases.len());
    let distinct: std::collections::HashSet<&serde_json::Value> = cases.iter().map(|c| &c["tokens"]).collect();
    assert!(distinct.len() >= 5, "the policies decode alike");
    for c in cases {
        let prompt: Vec<u32> = serde_json::from_value(c["prompt_ids"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(c["tokens"].clone()).unwrap();
        let gen = c["gen"].as_u64().unwrap() as usize;
        let mut engine = ponder::EngineBuilder::new(root.join("assets/tiny-sdar")).diffusion(|o| o.unmask_policy_boxed(fixture_policy(c))).build().unwrap();
        let params = ponder::GenerationParams { ignore_eos: true, ..fixture_params(c, gen) };
        let out = engine.generate([prompt.clone()], &params).unwrap().remove(0).unwrap();
        assert_eq!(out.token_ids, want, "{} tokens of prompt, {} {} {:?}", prompt.len(), c["policy"], c["value"], params.sampling);
    }
}
