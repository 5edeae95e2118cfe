//! Tensor parallelism on the CPU, ranks as threads over the in-process communicator: a tiny
//! Ouro and a tiny Huginn split over 2 and 4 ranks — each rank with its heads, its MLP columns
//! and the K/V of its heads in its own runner — compute the whole model's logits (and Ouro's
//! gate logits), on every rank.

mod common;

use candle_core::{DType, Device, Tensor};
use ponder::diffusion::models::SdarConfig;
use ponder::engine::internals::LoopedRunner;
use ponder::kv::KvManager;
use ponder::loader::Weights;
use ponder::looped::layout::KvLayout;
use ponder::looped::models::{Huginn, LoopedModel, Ouro, OuroConfig};
use ponder::looped::{LoopedLaunch, LoopedRow, Stage};
use ponder::parallel::{Communicator, LocalGroup, TpRank};
use ponder::{EngineBuilder, KvLayoutKind, RequestId};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const BLOCK: usize = 16;
const LENS: [usize; 4] = [5, 17, 33, 9];

fn weights(dir: &Path) -> Weights {
    Weights::from_files(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu).unwrap()
}

/// A prefill of four ragged prompts at full depth, then one decode step on the argmax tokens:
/// each launch's next-token logits and gate logits (Huginn has no gate).
fn run(model: Box<dyn LoopedModel>) -> Vec<(Tensor, Option<Tensor>)> {
    let steps = model.spec().max_steps;
    let vocab = model.spec().vocab_size;
    let layout: Box<dyn KvLayout> = KvLayoutKind::DepthIndexed.build();
    let num_blocks = 4 * steps * 8;
    let mut kv = KvManager::new(num_blocks, BLOCK, layout.num_slots(steps));
    let runner = LoopedRunner::new(model, num_blocks, BLOCK, 0).unwrap();
    let step_slots: Vec<usize> = (0..steps).collect();
    let prompts: Vec<Vec<u32>> = LENS.iter().enumerate().map(|(i, &n)| ponder::bench::random_ids(n, vocab, 50 + i as u64)).collect();
    let mut rows = |toks: &[Vec<u32>], start: &[usize]| -> Vec<LoopedRow> {
        toks.iter()
            .zip(start)
            .enumerate()
            .map(|(i, (t, &s))| {
                assert!(kv.reserve(RequestId(i as u64), s + t.len()));
                LoopedRow::full_depth(RequestId(i as u64), t.clone(), s, kv.tables(RequestId(i as u64)).unwrap().to_vec())
            })
            .collect()
    };
    let prefill = LoopedLaunch { stage: Stage::Prefill, step_slots: step_slots.clone(), rows: rows(&prompts, &[0; 4]), kv_copies: vec![], reenter: false };
    let a = runner.forward(&prefill).unwrap();
    let (logits, gates) = (a.logits.unwrap(), a.gate_logits);
    let next: Vec<Vec<u32>> = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap().into_iter().map(|t| vec![t]).collect();
    let decode = LoopedLaunch { stage: Stage::FullDepthDecode, step_slots, rows: rows(&next, &LENS), kv_copies: vec![], reenter: false };
    let b = runner.forward(&decode).unwrap();
    vec![(logits, gates), (b.logits.unwrap(), b.gate_logits)]
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_dtype(DType::F64).unwrap(), b.to_dtype(DType::F64).unwrap());
    (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt()
        / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt()
}

/// `load(rank, comm)` on 2 and 4 ranks against `whole`: the same logits and gate logits
/// (1e-5 relative), the same bits on every rank, each rank with `kv_heads / world` K/V heads.
fn check_ranks(whole: &[(Tensor, Option<Tensor>)], kv_heads: usize, load: impl Fn(TpRank, Arc<dyn Communicator>) -> Box<dyn LoopedModel> + Sync) {
    for world in [2, 4] {
        let comms = LocalGroup::new(world, Duration::from_secs(60)).unwrap();
        let load = &load;
        let got: Vec<Vec<(Tensor, Option<Tensor>)>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let rank = TpRank::new(c.rank(), c.world_size()).unwrap();
                        let shard = load(rank, Arc::new(c));
                        assert_eq!(shard.spec().num_kv_heads, kv_heads / world, "a rank holds its K/V heads only");
                        run(shard)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, launches) in got.iter().enumerate() {
            for (i, ((l, g), (wl, wg))) in launches.iter().zip(whole).enumerate() {
                assert!(rel(l, wl) < 1e-5, "world {world} rank {r} launch {i}: logits {:e}", rel(l, wl));
                match (g, wg) {
                    (Some(g), Some(wg)) => assert!(rel(g, wg) < 1e-5, "world {world} rank {r} launch {i}: gate logits {:e}", rel(g, wg)),
                    (None, None) => {}
                    _ => panic!("gate logits on one side only"),
                }
                assert_eq!(rel(l, &got[0][i].0), 0.0, "every rank holds the same logits");
            }
        }
    }
}

#[test]
fn a_tensor_parallel_ouro_computes_the_whole_models_logits_on_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    // Four K/V heads, so that four ranks hold one each.
    let cfg = OuroConfig { num_key_value_heads: Some(4), ..ponder::testing::tiny_ouro_config(common::VOCAB) };
    ponder::testing::write_random_ouro(tmp.path(), &cfg, 3).unwrap();
    let whole = run(Box::new(Ouro::load(&cfg, &weights(tmp.path())).unwrap()));
    check_ranks(&whole, 4, |rank, comm| Box::new(Ouro::load_shard(&cfg, &weights(tmp.path()), rank, comm).unwrap()));
}

#[test]
fn a_tensor_parallel_huginn_computes_the_whole_models_logits_on_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    // Four heads with q/k biases, a prelude, a recurrent core and a coda.
    let cfg = ponder::testing::tiny_huginn_config(common::VOCAB);
    ponder::testing::write_random_huginn(tmp.path(), &cfg, 4).unwrap();
    let whole = run(Box::new(Huginn::load(&cfg, &weights(tmp.path())).unwrap()));
    check_ranks(&whole, 4, |rank, comm| Box::new(Huginn::load_shard(&cfg, &weights(tmp.path()), rank, comm).unwrap()));
}

#[test]
fn a_split_that_does_not_divide_the_heads_is_a_typed_error() {
    let tmp = tempfile::tempdir().unwrap();
    // Six heads over three K/V heads: two ranks take three heads each, but the K/V heads
    // neither split over two ranks nor replicate onto them.
    let cfg = OuroConfig { hidden_size: 96, num_attention_heads: 6, num_key_value_heads: Some(3), ..ponder::testing::tiny_ouro_config(common::VOCAB) };
    ponder::testing::write_random_ouro(tmp.path(), &cfg, 3).unwrap();
    let comms = LocalGroup::new(2, Duration::from_secs(5)).unwrap();
    let c = comms.into_iter().next().unwrap();
    let err = Ouro::load_shard(&cfg, &weights(tmp.path()), TpRank::new(0, 2).unwrap(), Arc::new(c)).unwrap_err();
    assert!(matches!(&err, ponder::Error::InvalidOption(m) if m.contains("K/V heads")), "{err:?}");
    let cfg = ponder::testing::tiny_ouro_config(common::VOCAB);
    let comms = LocalGroup::new(2, Duration::from_secs(5)).unwrap();
    let c = comms.into_iter().nth(1).unwrap();
    assert!(Ouro::load_shard(&cfg, &weights(tmp.path()), TpRank::new(0, 2).unwrap(), Arc::new(c)).is_err(), "rank and communicator disagree");
}

/// The logits of one row of `n` tokens (a prompt, then a block of masks) through a diffusion
/// model's layers, block-causal as a denoising step sees it.
fn diffusion_logits(model: &dyn ponder::diffusion::models::DiffusionModel) -> Tensor {
    use ponder::ops::{AttnMask, PagedBatch, PagedBatchHost};
    let s = model.spec().clone();
    let (block, page, dev) = (s.block_length.unwrap(), 16, Device::Cpu);
    let mut toks: Vec<u32> = ponder::bench::random_ids(40, s.vocab_size - 1, 9);
    toks.extend(std::iter::repeat_n(s.mask_token_id, block));
    let n = toks.len();
    let kv = ponder::kv::KvStore::new(s.num_layers, n.div_ceil(page), page, s.num_kv_heads, s.head_dim, DType::F32, &dev).unwrap();
    let host = PagedBatchHost {
        cu_q_lens: vec![0, n as u32],
        block_tables: vec![(0..n.div_ceil(page) as u32).collect()],
        context_lens: vec![n as u32],
        write_positions: (0..n as u32).collect(),
    };
    let batch = PagedBatch::new(host, page, AttnMask::BlockCausal(block), s.num_kv_heads * s.head_dim, &dev).unwrap();
    let h = model.embed(&Tensor::new(toks.as_slice(), &dev).unwrap()).unwrap();
    let rope = model.rope(&Tensor::new((0..n as u32).collect::<Vec<_>>().as_slice(), &dev).unwrap()).unwrap();
    model.head(&model.forward(&h, &rope, &batch, &kv).unwrap()).unwrap()
}

/// `load(arch, weights, rank, comm)` over 2 and 4 ranks: every rank computes `whole`.
fn check_diffusion_ranks<A: Sync>(
    arch: &A,
    dir: &Path,
    whole: &Tensor,
    load: impl Fn(&A, &Weights, TpRank, Arc<dyn Communicator>) -> ponder::Result<ponder::diffusion::models::DenseDiffusion> + Sync,
) {
    for world in [2, 4] {
        let comms = LocalGroup::new(world, Duration::from_secs(60)).unwrap();
        let load = &load;
        let got: Vec<Tensor> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let rank = TpRank::new(c.rank(), c.world_size()).unwrap();
                        diffusion_logits(&load(arch, &weights(dir), rank, Arc::new(c)).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, l) in got.iter().enumerate() {
            assert!(rel(l, whole) < 1e-5, "world {world} rank {r}: {:e}", rel(l, whole));
            assert_eq!(rel(l, &got[0]), 0.0, "every rank holds the same logits");
        }
    }
}

/// Mixture-of-experts layers split two ways: every expert's columns on every rank, or whole
/// experts per rank (expert parallelism), with the shared experts' columns — the same logits.
#[test]
fn tensor_and_expert_parallel_moe_models_compute_the_whole_models_logits() {
    use ponder::diffusion::models::{DenseDiffusion, Llada2, Sdar};
    use ponder::testing::*;
    let tmp = tempfile::tempdir().unwrap();
    let sdar = tmp.path().join("sdar_moe");
    let cfg = SdarConfig { num_key_value_heads: Some(4), ..tiny_sdar_moe_config(common::VOCAB) };
    write_random_sdar(&sdar, &cfg, 6).unwrap();
    let llada2 = tmp.path().join("llada2");
    let l2 = ponder::diffusion::models::Llada2Config { num_key_value_heads: Some(4), ..tiny_llada2_config(common::VOCAB) };
    write_random_llada2(&llada2, &l2, 7).unwrap();
    for (arch, dir) in [(Sdar::arch(&cfg), sdar), (Llada2::arch(&l2), llada2)] {
        let whole = diffusion_logits(&DenseDiffusion::load(&arch, &weights(&dir)).unwrap());
        check_diffusion_ranks(&arch, &dir, &whole, DenseDiffusion::load_shard);
        check_diffusion_ranks(&arch, &dir, &whole, DenseDiffusion::load_expert_shard);
    }
}

#[test]
fn a_tensor_parallel_sdar_computes_the_whole_models_logits_on_every_rank() {
    use ponder::diffusion::models::{DenseDiffusion, Sdar, SdarConfig};
    let tmp = tempfile::tempdir().unwrap();
    let cfg = SdarConfig { num_key_value_heads: Some(4), ..ponder::testing::tiny_sdar_config(common::VOCAB) };
    ponder::testing::write_random_sdar(tmp.path(), &cfg, 5).unwrap();
    let arch = Sdar::arch(&cfg);
    let whole = diffusion_logits(&DenseDiffusion::load(&arch, &weights(tmp.path())).unwrap());
    for world in [2, 4] {
        let comms = LocalGroup::new(world, Duration::from_secs(60)).unwrap();
        let got: Vec<Tensor> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let (arch, dir) = (&arch, tmp.path());
                    s.spawn(move || {
                        let rank = TpRank::new(c.rank(), c.world_size()).unwrap();
                        let shard = DenseDiffusion::load_shard(arch, &weights(dir), rank, Arc::new(c)).unwrap();
                        assert_eq!(ponder::diffusion::models::DiffusionModel::spec(&shard).num_kv_heads, 4 / world);
                        diffusion_logits(&shard)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, l) in got.iter().enumerate() {
            assert!(rel(l, &whole) < 1e-5, "world {world} rank {r}: {:e}", rel(l, &whole));
            assert_eq!(rel(l, &got[0]), 0.0, "every rank holds the same logits");
        }
    }
}

/// Greedy tokens (and, for looped models, each token's log-probability) of every prompt, all
/// queued at once, through `builder`'s engine; the KV pool is empty afterwards.
fn engine_outputs(builder: ponder::EngineBuilder, prompts: &[Vec<u32>], logprobs: bool) -> Vec<(Vec<u32>, Vec<f64>)> {
    let mut engine = builder.build().unwrap();
    let params = ponder::GenerationParams { logprobs: logprobs.then_some(0), ..ponder::GenerationParams::greedy(8) };
    let ids: Vec<RequestId> = prompts.iter().map(|p| engine.add_request(p.clone(), params.clone()).unwrap()).collect();
    let mut got: std::collections::HashMap<RequestId, (Vec<u32>, Vec<f64>)> = Default::default();
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            match ev {
                ponder::Event::Token { id, token, logprob, .. } => {
                    let out = got.entry(id).or_default();
                    out.0.push(token);
                    out.1.extend(logprob.map(|l| l.logprob as f64));
                }
                ponder::Event::Finished { id, reason, .. } => assert!(!matches!(reason, ponder::FinishReason::Error(_)), "{id:?}: {reason:?}"),
            }
        }
    }
    common::assert_kv_empty(&engine);
    ids.iter().map(|id| got.remove(id).unwrap_or_default()).collect()
}

/// The same generations through one device and through `worlds` tensor-parallel ranks: the
/// same greedy tokens, log-probabilities within 1e-4.
fn check_engine(name: &str, builder: impl Fn() -> ponder::EngineBuilder, worlds: &[usize], logprobs: bool) {
    let prompts = common::diffusion_prompts(6, 11);
    let whole = engine_outputs(builder(), &prompts, logprobs);
    assert!(whole.iter().all(|(t, _)| t.len() == 8), "{name}: every request generated its tokens");
    for &world in worlds {
        let got = engine_outputs(builder().tensor_parallel(world), &prompts, logprobs);
        for (i, ((t, lp), (wt, wlp))) in got.iter().zip(&whole).enumerate() {
            assert_eq!(t, wt, "{name} over {world} ranks, request {i}: tokens");
            assert_eq!(lp.len(), wlp.len());
            for (a, b) in lp.iter().zip(wlp) {
                assert!((a - b).abs() < 1e-4, "{name} over {world} ranks, request {i}: log-probability {a} against {b}");
            }
        }
    }
}

#[test]
fn engines_over_two_and_four_ranks_generate_what_one_device_does() {
    use ponder::testing::*;
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| tmp.path().join(name);
    // Four K/V heads where four ranks are asked for (a rank holds whole K/V heads).
    write_random_ouro(&dir("ouro"), &OuroConfig { num_key_value_heads: Some(4), ..tiny_ouro_config(common::VOCAB) }, 31).unwrap();
    write_random_huginn(&dir("huginn"), &tiny_huginn_config(common::VOCAB), 32).unwrap();
    for (name, depth) in
        [("ouro", ponder::SchedulerKind::Continuous), ("ouro", ponder::SchedulerKind::Depth { refill: true }), ("huginn", ponder::SchedulerKind::Continuous)]
    {
        let d = dir(name);
        let builder = || EngineBuilder::new(&d).looped(|o| o.scheduler(depth)).max_num_seqs(4).block_size(4).max_num_batched_tokens(64);
        check_engine(&format!("{name} {depth:?}"), builder, &[2, 4], true);
    }
    // More ranks than K/V heads: two K/V heads over four ranks, each K/V head on the two ranks
    // whose query heads read it.
    write_random_ouro(&dir("ouro_gqa"), &tiny_ouro_config(common::VOCAB), 36).unwrap();
    let d = dir("ouro_gqa");
    check_engine("ouro, K/V heads replicated", || EngineBuilder::new(&d).max_num_seqs(4).block_size(4).max_num_batched_tokens(64), &[4], true);
    // Depth batching with early exits: the stock gate (gate logits from every rank's whole
    // hidden state), a learned lookahead head installed into every shard, and replayed depths
    // with a launch in flight (overlap: two launches queued on the ranks at once).
    let d = dir("ouro");
    for (gate, make) in common::gates().into_iter().filter(|(g, _)| ["q-exit", "learned-lookahead", "replay"].contains(g)) {
        let builder = || {
            let overlap = gate != "q-exit";
            EngineBuilder::new(&d)
                .looped(|o| {
                    o.scheduler(ponder::SchedulerKind::Depth { refill: true }).kv_layout(KvLayoutKind::LastExited).exit_gate_boxed(make()).overlap(overlap)
                })
                .max_num_seqs(4)
                .block_size(4)
                .max_num_batched_tokens(64)
        };
        check_engine(&format!("ouro depth batching, gate {gate}"), builder, &[2], true);
    }
    write_random_sdar(&dir("sdar"), &SdarConfig { num_key_value_heads: Some(4), ..tiny_sdar_config(common::VOCAB) }, 33).unwrap();
    write_random_llada(&dir("llada"), &ponder::diffusion::models::LladaConfig { n_kv_heads: Some(4), ..tiny_llada_config(common::VOCAB) }, 34).unwrap();
    write_random_dream(&dir("dream"), &ponder::diffusion::models::DreamConfig { num_key_value_heads: Some(4), ..tiny_dream_config(common::VOCAB) }, 35)
        .unwrap();
    write_random_sdar(&dir("sdar_gqa"), &tiny_sdar_config(common::VOCAB), 37).unwrap();
    for (name, worlds) in [("sdar", &[2, 4][..]), ("llada", &[2, 4]), ("dream", &[2, 4]), ("sdar_gqa", &[4])] {
        let d = dir(name);
        let builder = || EngineBuilder::new(&d).diffusion(|o| o.block_length(8)).max_num_seqs(4).block_size(4).kv_capacity_tokens(2048);
        check_engine(name, builder, worlds, false);
    }
    // Mixture-of-experts models, their experts' columns split or the experts themselves.
    // (Four K/V heads: four ranks hold one each; eight experts: two each.)
    write_random_sdar(&dir("sdar_moe"), &SdarConfig { num_key_value_heads: Some(4), ..tiny_sdar_moe_config(common::VOCAB) }, 36).unwrap();
    write_random_llada2(&dir("llada2"), &ponder::diffusion::models::Llada2Config { num_key_value_heads: Some(4), ..tiny_llada2_config(common::VOCAB) }, 37)
        .unwrap();
    for name in ["sdar_moe", "llada2"] {
        let d = dir(name);
        let prompts = common::diffusion_prompts(6, 11);
        let builder = || EngineBuilder::new(&d).diffusion(|o| o.block_length(8)).max_num_seqs(4).block_size(4).kv_capacity_tokens(2048);
        let whole = engine_outputs(builder(), &prompts, false);
        for (world, ep) in [(2, false), (2, true), (4, false), (4, true)] {
            let got = engine_outputs(builder().tensor_parallel(world).expert_parallel(ep), &prompts, false);
            assert_eq!(got, whole, "{name} over {world} ranks, expert parallel {ep}");
        }
    }
    // FOCUS: importance summed over the ranks' heads, the same tokens kept on every rank.
    let d = dir("sdar");
    let focus = || {
        EngineBuilder::new(&d)
            .diffusion(|o| o.block_length(16).delayed_cache(true).eviction_policy(ponder::diffusion::Focus::default()))
            .max_num_seqs(4)
            .block_size(4)
            .kv_capacity_tokens(4096)
    };
    check_engine("sdar with FOCUS", focus, &[2, 4], false);
}

/// Sampled generation (temperature, top-p, a seed per request): every rank draws the same
/// tokens from the same logits, and they are the ones one device draws.
#[test]
fn sampled_generation_over_ranks_draws_what_one_device_draws() {
    use ponder::testing::*;
    let tmp = tempfile::tempdir().unwrap();
    let (ouro, sdar) = (tmp.path().join("ouro"), tmp.path().join("sdar"));
    write_random_ouro(&ouro, &tiny_ouro_config(common::VOCAB), 41).unwrap();
    write_random_sdar(&sdar, &tiny_sdar_config(common::VOCAB), 42).unwrap();
    let prompts = common::diffusion_prompts(4, 12);
    let sample = |b: EngineBuilder| -> Vec<Vec<u32>> {
        let mut e = b.max_num_seqs(4).block_size(4).kv_capacity_tokens(2048).build().unwrap();
        let params = |i: u64| ponder::GenerationParams {
            sampling: ponder::SamplingParams { temperature: 0.9, top_p: Some(0.95), seed: Some(100 + i), ..Default::default() },
            ..ponder::GenerationParams::greedy(10)
        };
        prompts.iter().enumerate().map(|(i, p)| e.generate([p.clone()], &params(i as u64)).unwrap().remove(0).unwrap().token_ids).collect()
    };
    let looped = || EngineBuilder::new(&ouro);
    let diffusion = || EngineBuilder::new(&sdar).diffusion(|o| o.block_length(8));
    assert_eq!(sample(looped().tensor_parallel(2)), sample(looped()), "Ouro");
    assert_eq!(sample(diffusion().tensor_parallel(2)), sample(diffusion()), "SDAR");
}

#[test]
fn a_split_the_model_cannot_take_is_refused_at_build() {
    use ponder::testing::*;
    let tmp = tempfile::tempdir().unwrap();
    write_random_ouro(tmp.path(), &tiny_ouro_config(common::VOCAB), 3).unwrap(); // four heads, two K/V heads
    for n in [0, 3, 8] {
        let err = EngineBuilder::new(tmp.path()).tensor_parallel(n).build().err().expect("refused");
        assert!(matches!(err, ponder::Error::InvalidOption(_)), "tensor_parallel({n}): {err:?}");
    }
    // Devices given one by one: two CPU ranks serve; none is refused.
    let mut two = EngineBuilder::new(tmp.path()).tensor_parallel_on(vec![Device::Cpu, Device::Cpu]).build().unwrap();
    assert_eq!(two.generate([vec![1u32, 2, 3]], &ponder::GenerationParams::greedy(4)).unwrap().remove(0).unwrap().token_ids.len(), 4);
    assert!(matches!(EngineBuilder::new(tmp.path()).tensor_parallel_on(vec![]).build(), Err(ponder::Error::InvalidOption(_))));
    // Expert parallelism needs ranks and experts.
    let err = EngineBuilder::new(tmp.path()).tensor_parallel(2).expert_parallel(true).build().err().expect("refused");
    assert!(matches!(&err, ponder::Error::InvalidOption(m) if m.contains("mixture-of-experts")), "{err:?}");
    let moe = tmp.path().join("moe");
    write_random_sdar(&moe, &tiny_sdar_moe_config(common::VOCAB), 4).unwrap();
    let err = EngineBuilder::new(&moe).expert_parallel(true).build().err().expect("refused");
    assert!(matches!(&err, ponder::Error::InvalidOption(m) if m.contains("tensor_parallel")), "{err:?}");
    // Eight experts do not split over three ranks (nor do the heads).
    assert!(EngineBuilder::new(&moe).tensor_parallel(3).expert_parallel(true).build().is_err());
}
