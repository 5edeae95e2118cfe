//! Tensor and expert parallelism on GPUs over NCCL. Needs a CUDA build and at least two GPUs
//! (each test says so and returns on fewer); NCCL is found at run time (`libnccl.so.2` on the
//! loader's path or `LD_LIBRARY_PATH`; PyTorch's wheels ship one under
//! `site-packages/nvidia/nccl/lib`).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use ponder::parallel::{group, rank_devices, Communicator, LocalGroup};
use ponder::{EngineBuilder, GenerationParams};
use std::sync::Arc;
use std::time::Duration;

fn gpus() -> usize {
    candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize
}

/// The GPUs of a group of `world`, or `None` (with a note) on a machine with fewer.
fn devices(world: usize) -> Option<Vec<Device>> {
    if gpus() < world {
        eprintln!("skipped: {world} GPUs needed, {} here", gpus());
        return None;
    }
    Some(rank_devices(&Device::new_cuda(0).unwrap(), world).unwrap())
}

/// `f(rank, comm, device)` on every rank's thread, in rank order.
fn on_ranks<T: Send>(comms: &[Arc<dyn Communicator>], devices: &[Device], f: impl Fn(usize, &dyn Communicator, &Device) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(devices)
            .enumerate()
            .map(|(r, (c, d))| {
                s.spawn({
                    let f = &f;
                    move || f(r, c.as_ref(), d)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// NCCL's collectives give what the in-process group gives (f32: all-reduce in rank order is
/// exact for these integers), every rank the same.
#[test]
fn nccl_collectives_agree_with_the_in_process_group() {
    for world in [2, 4] {
        let Some(devices) = devices(world) else { return };
        let nccl = group(&devices, Duration::from_secs(60)).unwrap();
        let local: Vec<Arc<dyn Communicator>> =
            LocalGroup::new(world, Duration::from_secs(60)).unwrap().into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>).collect();
        let cpus = vec![Device::Cpu; world];
        let job = |r: usize, c: &dyn Communicator, d: &Device| {
            let x = Tensor::arange(0f32, 12., d).unwrap().reshape((3, 4)).unwrap().affine(1.0, 16.0 * r as f64).unwrap();
            let sum = values(&c.all_reduce_sum(&x).unwrap());
            let bf = values(&c.all_reduce_sum(&x.to_dtype(DType::BF16).unwrap()).unwrap());
            let gathered = values(&c.all_gather(&x, 1).unwrap());
            // Rank r sends j + 1 rows to rank j.
            let parts = (0..c.world_size()).map(|j| Tensor::full((10 * r + j) as f32, (j + 1, 2), d).unwrap()).collect();
            let received: Vec<Vec<f32>> = c.all_to_all(parts).unwrap().iter().map(values).collect();
            (sum, bf, gathered, received)
        };
        let got = on_ranks(&nccl, &devices, job);
        let want = on_ranks(&local, &cpus, job);
        assert_eq!(got, want, "world {world}");
    }
}

/// One tiny random checkpoint of each family split over 2 GPUs (and 4 where heads allow)
/// generates what one GPU does (f32: the sums' order is the only difference).
#[test]
fn engines_over_gpus_generate_what_one_gpu_does() {
    use ponder::testing::*;
    let Some(_) = devices(2) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    write_random_ouro(&dir("ouro"), &ponder::looped::models::OuroConfig { num_key_value_heads: Some(4), ..tiny_ouro_config(97) }, 1).unwrap();
    write_random_sdar(&dir("sdar"), &tiny_sdar_config(97), 3).unwrap();
    write_random_llada2(&dir("llada2"), &tiny_llada2_config(97), 7).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| ponder::bench::random_ids(5 + 3 * i, 96, i as u64)).collect();
    let params = GenerationParams::greedy(12);
    for (name, worlds, ep) in [("ouro", &[2, 4][..], false), ("sdar", &[2], false), ("llada2", &[2], false), ("llada2", &[2], true)] {
        let d = dir(name);
        let builder = || {
            let b = EngineBuilder::new(&d).device(Device::new_cuda(0).unwrap()).dtype(DType::F32).max_num_seqs(6).kv_capacity_tokens(4096);
            if name == "ouro" {
                b
            } else {
                b.diffusion(|o| o.block_length(8))
            }
        };
        let tokens = |b: EngineBuilder| -> Vec<Vec<u32>> {
            b.build().unwrap().generate(prompts.clone(), &params).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect()
        };
        let whole = tokens(builder());
        for &world in worlds {
            if gpus() < world {
                continue;
            }
            let b = builder().tensor_parallel(world).expert_parallel(ep);
            assert_eq!(tokens(b), whole, "{name} over {world} GPUs (expert parallel {ep})");
        }
    }
}
