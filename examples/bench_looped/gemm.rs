//! Suite `gemm`: the model's decode-width dense products (cuBLAS, as `ops::split_k` runs them)
//! against the copy bandwidth, bf16, at each `--widths` row count, `--repeats` rounds (the best
//! of them kept).
//!
//! A layer runs as the decode body runs it: the projections that feed a norm (Ouro's o_proj and
//! down, Huginn's proj and mlp proj) as f32 partial products over the k slices `split_k_plan`
//! gives them (marked `*`; then at every other count of 1, 2, 4 or 8 slices that keeps them
//! whole vectors), the head as f32 logits, the rest rounded to bf16, each into a buffer made
//! once. A burst of launches cycles through enough copies of the weight to overflow the L2
//! cache, so every launch reads its weight from memory, and is timed two ways: issued eagerly
//! from the host (the median of five bursts), and captured once as a CUDA graph then replayed
//! (the median of five replays), as a decode graph runs it. Eager time at a few rows is mostly
//! the host's cost of a launch; the graph's is the GPU's. The rate is the weight's bytes over
//! the graph's time, set against the measured device-to-device copy bandwidth. The weights are
//! the layer's shape only: the suite makes no model.
//!
//! With `--quantization fp8` each layer but the head (which FP8 leaves in bf16) is also timed as
//! the FP8 body runs it: the weight in E4M3 with per-row scales, the whole product
//! (`ops::fp8_matmul`, under `--kernels`: e.g. `fp8=weight-only`) replayed in a graph, its bytes
//! (half the bf16 weight's) over its time against the copy bandwidth, and bf16's graph time over
//! FP8's; a projection that feeds a norm also as the weight-only kernel's 2, 4 and 8 k slices
//! (`fp8-split-k`); and, where the GPU has cuBLASLt's FP8 GEMM, W8A8's two launches apart (the
//! activations' quantization, `quant`; the GEMM on activations quantized beforehand, `w8a8`).
//! Each line also gives its graph's memory nodes: none where the products write into buffers
//! made once (the FP8 products allocate their outputs).

use candle_core::{DType, Device, Tensor};
use ponder::engine::internals::{GemmWorkspace, Graph};
use ponder::ops::{fp8_matmul, into, split_k};
use ponder::quant::{Fp8Weight, Quantization};
use std::sync::Arc;
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

/// Median seconds of one launch of `f` over five bursts of `per_burst` launches issued from the
/// host.
fn eager_launch(device: &Device, per_burst: usize, f: &impl Fn(usize) -> candle_core::Result<()>) -> candle_core::Result<f64> {
    f(0)?;
    median_of_five(device, per_burst, || (0..per_burst).try_for_each(f))
}

/// Median seconds of one launch of `f` over five replays of a graph of `per_burst` launches
/// (captured with cuBLAS working in `workspace`, as the engine captures), and the memory nodes
/// of that graph (none unless something in `f` allocates).
fn graph_launch(
    device: &Device,
    workspace: &Arc<GemmWorkspace>,
    per_burst: usize,
    f: &impl Fn(usize) -> candle_core::Result<()>,
) -> candle_core::Result<(f64, usize)> {
    Graph::warm_up(device, || f(0))?;
    let graph = Graph::capture(device, workspace, || (0..per_burst).try_for_each(f))?;
    graph.launch()?;
    let memory = graph.nodes()?.memory;
    Ok((median_of_five(device, per_burst, || graph.launch())?, memory))
}

/// Median seconds a launch over five runs of `burst` (`per_burst` launches each), the device
/// synchronised before and after each.
fn median_of_five(device: &Device, per_burst: usize, mut burst: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    device.synchronize()?;
    let mut times = Vec::with_capacity(5);
    for _ in 0..5 {
        let t = Instant::now();
        burst()?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64() / per_burst as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// The best (least) of a layer's rounds.
fn best(rounds: &[f64]) -> f64 {
    rounds.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The suite over `model`'s layers (`ouro` or `huginn`) at `rows` rows each; prints a line a
/// (layer, rows, slices) and returns them as JSON.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_suite(
    model: &str,
    rows: &[usize],
    rounds: usize,
    device: &Device,
    bandwidth: f64,
    quantization: Quantization,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    println!("{:<12} {:<9} {:>4} {:>6} {:>6} {:>3} {:>9} {:>9} {:>7} {:>4}", "model", "layer", "rows", "n", "k", "sl", "eager us", "graph us", "of bw", "mem");
    let workspace = Arc::new(GemmWorkspace::new(device)?);
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
            // The bf16 time FP8 is set against: the first count timed (the planned one).
            let mut bf16_s = None;
            let counts: Vec<usize> = match layer.output {
                Output::Partials => std::iter::once(planned).chain([1, 2, 4, 8].into_iter().filter(|&s| s != planned && layer.k % (s * 8) == 0)).collect(),
                _ => vec![1],
            };
            for slices in counts {
                let out = match layer.output {
                    Output::Rounded => Tensor::zeros((r, layer.n), DType::BF16, device)?,
                    Output::Partials | Output::Logits => Tensor::zeros((slices, r, layer.n), DType::F32, device)?,
                };
                let run = |i: usize| -> candle_core::Result<()> {
                    let w = &weights[i % copies];
                    match layer.output {
                        Output::Rounded => into::linear_into(&x, w, &out),
                        Output::Partials | Output::Logits => partials_into(&x, w, slices, &out),
                    }
                };
                let per_burst = copies.max(20);
                let (mut eager, mut graph, mut memory_nodes) = (Vec::new(), Vec::new(), 0);
                for _ in 0..rounds {
                    eager.push(eager_launch(device, per_burst, &run)?);
                    let (t, memory) = graph_launch(device, &workspace, per_burst, &run)?;
                    graph.push(t);
                    memory_nodes = memory_nodes.max(memory);
                }
                let (te, tg) = (best(&eager), best(&graph));
                let of_bw = bytes as f64 / tg / bandwidth;
                let is_planned = matches!(layer.output, Output::Partials) && slices == planned;
                println!(
                    "{:<12} {:<9} {:>4} {:>6} {:>6} {:>3}{} {:>8.1} {:>9.1} {:>6.1}% {:>4}",
                    layer.model,
                    layer.name,
                    r,
                    layer.n,
                    layer.k,
                    slices,
                    if is_planned { "*" } else { " " },
                    te * 1e6,
                    tg * 1e6,
                    100.0 * of_bw,
                    memory_nodes
                );
                records.push(serde_json::json!({
                    "model": layer.model, "layer": layer.name, "rows": r, "n": layer.n, "k": layer.k,
                    "output": format!("{:?}", layer.output), "slices": slices, "planned": is_planned, "weight_bytes": bytes,
                    "eager_s": eager, "graph_s": graph, "graph_of_copy_bandwidth": of_bw, "graph_memory_nodes": memory_nodes,
                }));
                bf16_s.get_or_insert(tg);
            }
            // The heads stay in the engine's dtype under FP8: no FP8 product to time there.
            if quantization == Quantization::Fp8 && !matches!(layer.output, Output::Logits) {
                let bf16_s = bf16_s.expect("every layer times at least one count");
                records.extend(fp8_layer(&layer, r, &x, rounds, (device, &workspace), bandwidth, bf16_s)?);
            }
        }
    }
    Ok(serde_json::Value::Array(records))
}

/// `layer` at `rows` rows as the FP8 body runs it (the whole product through `fp8_matmul` under
/// the policy in force) and, for a projection that feeds a norm, as the weight-only kernel's k
/// slices (2, 4 and 8 where k holds that many 64-wide chunks, into an f32 buffer made once),
/// each replayed in a graph over copies of an E4M3 weight cycled past the L2; printed against
/// `bf16_s`, the bf16 product's graph time.
fn fp8_layer(
    layer: &Layer,
    rows: usize,
    x: &Tensor,
    rounds: usize,
    (device, workspace): (&Device, &Arc<GemmWorkspace>),
    bandwidth: f64,
    bf16_s: f64,
) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    let bytes = layer.n * layer.k + layer.n * 4;
    let copies = (200usize << 20).div_ceil(bytes).max(2);
    let weights = (0..copies)
        .map(|_| Fp8Weight::quantize(&Tensor::randn(0f32, 0.02, (layer.n, layer.k), device)?.to_dtype(DType::BF16)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let counts: Vec<usize> = match layer.output {
        Output::Partials => std::iter::once(1).chain([2, 4, 8].into_iter().filter(|&s| s <= layer.k.div_ceil(64))).collect(),
        _ => vec![1],
    };
    let mut records = Vec::new();
    for slices in counts {
        let parts = Tensor::zeros((slices, rows, layer.n), DType::F32, device)?;
        let run = |i: usize| match slices {
            1 => fp8_matmul(x, &weights[i % copies], None).map(drop),
            _ => fp8_partials_into(x, &weights[i % copies], slices, &parts),
        };
        let timed = graph_rounds(device, workspace, copies.max(20), rounds, &run)?;
        let output = if slices == 1 { "Fp8Whole" } else { "Fp8Partials" };
        records.push(fp8_line(layer, rows, slices, ("fp8", output), bytes, timed, bandwidth, bf16_s));
    }
    #[cfg(feature = "cuda")]
    records.extend(w8a8_parts(layer, rows, x, &weights, rounds, (device, workspace), bandwidth, bf16_s)?);
    Ok(records)
}

/// W8A8's two launches apart, where the GPU has cuBLASLt's FP8 GEMM: the activations' per-row
/// quantization alone (`quantize_rows`), and the FP8 GEMM alone on activations quantized once
/// beforehand (`fp8_w8a8_quantized`), as it would run if the op before it wrote its output in
/// E4M3 — what fusing the quantization into that op could buy.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn w8a8_parts(
    layer: &Layer,
    rows: usize,
    x: &Tensor,
    weights: &[Fp8Weight],
    rounds: usize,
    (device, workspace): (&Device, &Arc<GemmWorkspace>),
    bandwidth: f64,
    bf16_s: f64,
) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    use ponder::ops::cuda::{fp8_gemm_serves, fp8_w8a8_quantized, quantize_rows};
    use ponder::quant::Fp8Scale;
    if !device.is_cuda() || !fp8_gemm_serves(x.dtype(), rows, layer.n, layer.k) {
        return Ok(vec![]);
    }
    let (xq, xs) = quantize_rows(x)?;
    if fp8_w8a8_quantized(&xq, &xs, weights[0].data(), per_channel(&weights[0])?, x.dtype())?.is_none() {
        return Ok(vec![]); // no FP8 GEMM on this GPU
    }
    fn per_channel(w: &Fp8Weight) -> candle_core::Result<&Tensor> {
        match w.scale() {
            Fp8Scale::PerChannel(s) => Ok(s),
            Fp8Scale::Block { .. } => candle_core::bail!("the suite quantizes per channel"),
        }
    }
    let bytes = layer.n * layer.k + layer.n * 4;
    let copies = weights.len();
    let gemm = |i: usize| fp8_w8a8_quantized(&xq, &xs, weights[i % copies].data(), per_channel(&weights[i % copies])?, x.dtype()).map(drop);
    let quantize = |_: usize| quantize_rows(x).map(drop);
    let per_burst = copies.max(20);
    let gemm_timed = graph_rounds(device, workspace, per_burst, rounds, &gemm)?;
    let quantize_timed = graph_rounds(device, workspace, per_burst, rounds, &quantize)?;
    Ok(vec![
        fp8_line(layer, rows, 1, ("w8a8", "W8A8Gemm"), bytes, gemm_timed, bandwidth, bf16_s),
        fp8_line(layer, rows, 1, ("quant", "QuantizeRows"), 0, quantize_timed, bandwidth, bf16_s),
    ])
}

/// `run` captured as a graph and replayed, `rounds` times: each round's time, and the most
/// memory nodes a round's graph held.
fn graph_rounds(
    device: &Device,
    workspace: &Arc<GemmWorkspace>,
    per_burst: usize,
    rounds: usize,
    run: &impl Fn(usize) -> candle_core::Result<()>,
) -> candle_core::Result<(Vec<f64>, usize)> {
    let (mut graph, mut memory_nodes) = (Vec::new(), 0);
    for _ in 0..rounds {
        let (t, memory) = graph_launch(device, workspace, per_burst, run)?;
        graph.push(t);
        memory_nodes = memory_nodes.max(memory);
    }
    Ok((graph, memory_nodes))
}

/// One FP8 line of a layer, printed beside bf16's graph time `bf16_s`, and its JSON record:
/// `tag` printed, `output` recorded; `bytes` the weight bytes it reads (0: none).
#[allow(clippy::too_many_arguments)]
fn fp8_line(
    layer: &Layer,
    rows: usize,
    slices: usize,
    (tag, output): (&str, &str),
    bytes: usize,
    (graph, memory_nodes): (Vec<f64>, usize),
    bandwidth: f64,
    bf16_s: f64,
) -> serde_json::Value {
    let t = best(&graph);
    let of_bw = bytes as f64 / t / bandwidth;
    println!(
        "{:<12} {:<9} {:>4} {:>6} {:>6} {:>3} {:<5} {:>13.1} {:>6.1}% {:>4} ({:.2}x bf16)",
        layer.model,
        layer.name,
        rows,
        layer.n,
        layer.k,
        slices,
        tag,
        t * 1e6,
        100.0 * of_bw,
        memory_nodes,
        bf16_s / t
    );
    serde_json::json!({
        "model": layer.model, "layer": layer.name, "rows": rows, "n": layer.n, "k": layer.k,
        "output": output, "slices": slices, "weight_bytes": bytes, "graph_s": graph, "graph_of_copy_bandwidth": of_bw,
        "graph_memory_nodes": memory_nodes, "bf16_graph_s": bf16_s, "bf16_over_fp8": bf16_s / t,
    })
}

/// The weight-only FP8 kernel's k slices of `x · Wᵀ` into `out` (`[slices, rows, n]` f32): on
/// CUDA the kernel, elsewhere its CPU composition.
fn fp8_partials_into(x: &Tensor, w: &Fp8Weight, slices: usize, out: &Tensor) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use ponder::ops::cuda::WeightScale;
        use ponder::quant::Fp8Scale;
        let scale = match w.scale() {
            Fp8Scale::PerChannel(s) => WeightScale::Rows(s),
            Fp8Scale::Block { scale, block } => WeightScale::Blocks { scale, block: *block },
        };
        return ponder::ops::cuda::fp8_linear_partials(x, w.data(), scale, slices, Some(out)).map(drop);
    }
    out.slice_set(&split_k::fp8_linear_partials_reference(x, w, slices)?, 0, 0)
}

/// `x · wᵀ` as f32 partials over `slices` k slices into `out` (`[slices, rows, n]`), as the
/// decode arena runs a projection that feeds a norm (and, in one slice, the head's logits).
fn partials_into(x: &Tensor, w: &Tensor, slices: usize, out: &Tensor) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return ponder::ops::cuda::linear_partials_into(x, w, slices, out);
    }
    out.slice_set(&split_k::linear_partials(x, w, slices)?, 0, 0)
}
