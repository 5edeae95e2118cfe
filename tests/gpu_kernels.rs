//! CUDA kernels against the CPU reference. Needs a GPU: build with `--features cuda`, run on the
//! device machine, one test at a time (`--test-threads 1`, as `tools/device/call.sh` runs it);
//! `--include-ignored --nocapture` also prints the timings. One module per family of kernels:
//! `attention` (paged attention's paths), `agreement` (those paths through a whole looped decode),
//! `qkv_rope` (the projection's epilogues, folded attention), `layer_ops` (norms, split-K, SiLU,
//! RoPE angles), `rows` (row movement, greedy picks), `graphs` (captured decode graphs, the
//! arena), `models` (whole models, non-finite handling), `moe` and `fp8`. This file holds what
//! they share: a kept device, random tensors, tolerances.
#![cfg(feature = "cuda")]

#[path = "gpu_kernels/agreement.rs"]
mod agreement;
#[path = "gpu_kernels/attention.rs"]
mod attention;
#[path = "gpu_kernels/fp8.rs"]
mod fp8;
#[path = "gpu_kernels/graphs.rs"]
mod graphs;
#[path = "gpu_kernels/layer_ops.rs"]
mod layer_ops;
#[path = "gpu_kernels/models.rs"]
mod models;
#[path = "gpu_kernels/moe.rs"]
mod moe;
#[path = "gpu_kernels/qkv_rope.rs"]
mod qkv_rope;
#[path = "gpu_kernels/rows.rs"]
mod rows;

use attention::*;
use graphs::*;

use candle_core::{DType, Device, Tensor};
use ponder::ops::{paged_attention, paged_attention_reference, AttnMask, PagedBatch, PagedBatchHost};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// A CUDA device of its own (stream, cuBLAS handle, loaded modules) for one test, kept alive
/// until the process exits. Dropping a device destroys its cuBLAS handle, which synchronises the
/// whole GPU context; a context-wide synchronisation while another test's thread captures a CUDA
/// graph on its own stream is refused by the driver and invalidates that capture (the parallel
/// suite failed and crashed that way). Tests therefore never drop a device mid-run.
fn gpu_device() -> Device {
    static KEPT: std::sync::Mutex<Vec<Device>> = std::sync::Mutex::new(Vec::new());
    let device = Device::new_cuda(0).unwrap();
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(device.clone());
    device
}

fn rel_err(out: &Tensor, reference: &Tensor) -> f32 {
    let o = out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let r = reference.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(o.len(), r.len());
    let mut num = 0f64;
    let mut den = 0f64;
    for (a, b) in o.iter().zip(&r) {
        let d = (*a as f64) - (*b as f64);
        num += if d.is_nan() { f64::INFINITY } else { d * d };
        den += (*b as f64) * (*b as f64);
    }
    (num.sqrt() / den.sqrt().max(1e-30)) as f32
}

use ponder::ops::{fused, RopeAngles, RopeTable};

fn rand_tensor(rng: &mut StdRng, shape: &[usize], lo: f32, hi: f32, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let d: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_vec(d, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn f32_cpu(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
}

fn tol_of(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// The shipped tiny checkpoint `name` on `device` in f32. The binary runs where it was built or
/// from the repository root of another machine (the device's copy of the tree).
fn tiny_on(name: &str, device: &Device, max_num_seqs: usize) -> ponder::Engine {
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
    let dir = if built.exists() { built } else { std::path::PathBuf::from("assets") }.join(name);
    ponder::EngineBuilder::new(dir).device(device.clone()).dtype(DType::F32).max_num_seqs(max_num_seqs).build().unwrap()
}

/// Keeps a GPU engine to process exit: freeing its pool and graphs synchronises the context,
/// which would invalidate another test's graph capture (see [`gpu_device`]).
fn keep(engine: ponder::Engine) {
    static KEPT: std::sync::Mutex<Vec<ponder::Engine>> = std::sync::Mutex::new(Vec::new());
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(engine);
}
