//! Suite `gemm`: the model's decode-width dense products against the copy bandwidth, cuBLAS
//! (what `ops::split_k` runs by default) and the weight-streaming kernel
//! (`KernelPolicy::stream_gemm`) alternated in one process, bf16, at each `--widths` row count,
//! `--repeats` rounds (the best of them kept).
//!
//! A layer runs as the decode body runs it: the projections that feed a norm (Ouro's o_proj and
//! down, Huginn's proj and mlp proj) as f32 partial products over the k slices `split_k_plan`
//! gives them (marked `*`; then at every other count of 1, 2, 4 or 8 slices that keeps them
//! whole vectors), the head as f32 logits, the rest rounded to bf16. Each timing is the median of
//! five bursts of launches cycling through enough copies of the weight to overflow the L2 cache,
//! so every launch reads its weight from memory; the rate is the weight's bytes over that time,
//! set against the measured device-to-device copy bandwidth. The weights are the layer's shape
//! only: the suite makes no model.

use candle_core::{DType, Device, Tensor};
use ponder::ops::{into, split_k, with_kernels, KernelPolicy, StreamGemm};
use std::time::Instant;

/// What a layer's product produces in the decode body.
#[derive(Clone, Copy, Debug)]
enum Output {
    /// Rounded to the dtype (`ops::into::linear_into`).
    Rounded,
    /// f32 partial products over the k slices `split_k_plan` gives it (a norm sums them).
    Partials,
    /// f32 logits in one slice (`ops::linear_f32`).
    Logits,
}

struct Layer {
    model: &'static str,
    name: &'static str,
    n: usize,
    k: usize,
    output: Output,
}

fn layers(model: &str) -> Vec<Layer> {
    let ouro = |name, n, k, output| Layer { model: "ouro-1.4b", name, n, k, output };
    let huginn = |name, n, k, output| Layer { model: "huginn-0125", name, n, k, output };
    let mut out = Vec::new();
    if model == "ouro" {
        out.extend([
            ouro("qkv", 6144, 2048, Output::Rounded),
            ouro("o_proj", 2048, 2048, Output::Partials),
            ouro("gate_up", 11264, 2048, Output::Rounded),
            ouro("down", 2048, 5632, Output::Partials),
            ouro("head", 49152, 2048, Output::Logits),
        ]);
    }
    if model == "huginn" {
        out.extend([
            huginn("adapter", 5280, 10560, Output::Rounded),
            huginn("qkv", 15840, 5280, Output::Rounded),
            huginn("proj", 5280, 5280, Output::Partials),
            huginn("fc", 35840, 5280, Output::Rounded),
            huginn("mlp_proj", 5280, 17920, Output::Partials),
            huginn("head", 65536, 5280, Output::Logits),
        ]);
    }
    out
}

/// Median seconds of one launch of `f` over five bursts of `per_burst` launches.
fn median_launch(device: &Device, per_burst: usize, mut f: impl FnMut(usize) -> candle_core::Result<()>) -> candle_core::Result<f64> {
    f(0)?;
    device.synchronize()?;
    let mut times = Vec::with_capacity(5);
    for _ in 0..5 {
        let t = Instant::now();
        for i in 0..per_burst {
            f(i)?;
        }
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64() / per_burst as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// The suite over `model`'s layers (`ouro` or `huginn`) at `rows` rows each; prints a line a
/// (layer, rows) and returns them as JSON.
pub(crate) fn gemm_suite(model: &str, rows: &[usize], rounds: usize, device: &Device, bandwidth: f64) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    println!(
        "{:<12} {:<9} {:>4} {:>6} {:>6} {:>3} {:>10} {:>7} {:>10} {:>7} {:>8}",
        "model", "layer", "rows", "n", "k", "sl", "cuBLAS us", "of bw", "stream us", "of bw", "ratio"
    );
    let policies = [KernelPolicy::default(), KernelPolicy { stream_gemm: StreamGemm::All, ..KernelPolicy::default() }];
    let mut records = Vec::new();
    for layer in layers(model) {
        let bytes = layer.n * layer.k * 2;
        // Enough copies of the weight that cycling through them overflows a 50 MB L2 four times.
        let copies = (200usize << 20).div_ceil(bytes).max(2);
        let weights =
            (0..copies).map(|_| Tensor::randn(0f32, 0.02, (layer.n, layer.k), device)?.to_dtype(DType::BF16)).collect::<candle_core::Result<Vec<_>>>()?;
        for &r in rows {
            let x = Tensor::randn(0f32, 1.0, (r, layer.k), device)?.to_dtype(DType::BF16)?;
            // A projection that feeds a norm at the slices the plan gives it, and at every other
            // slice count up to 8 that keeps the slices whole vectors: whether the plan, made on
            // one card, holds on this one.
            let planned = split_k::split_k_plan(&x, layer.n).unwrap_or(1);
            let counts: Vec<usize> = match layer.output {
                Output::Partials => std::iter::once(planned).chain([1, 2, 4, 8].into_iter().filter(|&s| s != planned && layer.k % (s * 8) == 0)).collect(),
                _ => vec![1],
            };
            let out = Tensor::zeros((r, layer.n), DType::BF16, device)?;
            for slices in counts {
                let run = |i: usize| -> candle_core::Result<()> {
                    let w = &weights[i % copies];
                    match layer.output {
                        Output::Rounded => into::linear_into(&x, w, &out),
                        Output::Partials | Output::Logits => split_k::linear_partials(&x, w, slices).map(drop),
                    }
                };
                let mut seconds = [Vec::new(), Vec::new()];
                for _ in 0..rounds {
                    for (p, policy) in policies.iter().enumerate() {
                        let (t, counts) = with_kernels(*policy, || median_launch(device, copies.max(20), run));
                        if p == 1 && counts.stream_gemm == 0 {
                            return Err(format!("{} {} at {r} rows: the streaming kernel did not take it", layer.model, layer.name).into());
                        }
                        seconds[p].push(t?);
                    }
                }
                let best = |s: &Vec<f64>| s.iter().copied().fold(f64::INFINITY, f64::min);
                let (tc, ts) = (best(&seconds[0]), best(&seconds[1]));
                let of_bw = |t: f64| bytes as f64 / t / bandwidth;
                let is_planned = matches!(layer.output, Output::Partials) && slices == planned;
                println!(
                    "{:<12} {:<9} {:>4} {:>6} {:>6} {:>3}{} {:>10.1} {:>6.1}% {:>10.1} {:>6.1}% {:>7.2}x",
                    layer.model,
                    layer.name,
                    r,
                    layer.n,
                    layer.k,
                    slices,
                    if is_planned { "*" } else { " " },
                    tc * 1e6,
                    100.0 * of_bw(tc),
                    ts * 1e6,
                    100.0 * of_bw(ts),
                    tc / ts
                );
                records.push(serde_json::json!({
                    "model": layer.model, "layer": layer.name, "rows": r, "n": layer.n, "k": layer.k,
                    "output": format!("{:?}", layer.output), "slices": slices, "planned": is_planned, "weight_bytes": bytes,
                    "cublas_s": seconds[0], "stream_s": seconds[1],
                    "cublas_of_copy_bandwidth": of_bw(tc), "stream_of_copy_bandwidth": of_bw(ts),
                    "cublas_over_stream": tc / ts,
                }));
            }
        }
    }
    Ok(serde_json::Value::Array(records))
}
