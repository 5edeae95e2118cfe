//! Throughput of looped-LM serving on real model shapes with random weights generated on the
//! device (real checkpoints cannot be downloaded here; the CDB authors' method).
//!
//!     bench_looped [--model ouro|huginn] [--suite cb|cdb|gemm] [--widths 16,64,256] [--layout L]
//!                  [--json FILE] [--commit SHA] [--parity] [--tiny] [--kernels POLICY] [--quantization fp8]
//!       suite cb:  [--prompt-len 128] [--new-tokens 256] [--repeats 3] [--profile-step]
//!                  [--long-prompts 4096,8192,... [--budgets 2048,8192] [--arrival-gap-ms 150]]
//!       suite cdb: [--mean-depths 2.5,3.0 | --depth-traces LABEL=FILE[:on|off],...]
//!                  [--modes cb,cdb-no-refill,cdb-refill]
//!                  [--requests-per-width 3] [--min-depth 2] [--kv-gb 40] [--min-coda 1,quarter,half,full]
//!                  [--coda-reserve 0,parked] [--coda-pairs quarter:0,half:parked]
//!                  [--prompt-median 128] [--prompt-max 512] [--output-median 160] [--output-max 256]
//!                  [--overlap off,on] [--repeats 1] [--time-device] [--drain on|off]
//!                  [--window-completions K|2w]
//!
//! `--model huginn` runs Huginn-0125 shapes (3.5B, r_max 16) instead of Ouro-1.4B;
//! `--min-coda 1,quarter` compares a coda held for 1 exited token with one held for W/4;
//! `--coda-reserve 0,parked` runs refill with the paper's resident cap (W) and with W plus
//! min coda − 1 resident requests (launches still at most W rows), so tokens parked for the
//! held coda do not leave the core launch short (`--coda-pairs` lists (min coda, reserve)
//! pairs instead of every combination);
//! `--depth-traces sync=a.json:off,delayed=b.json:on` replays recorded per-token depths (the
//! `quality_gates` example writes them: what each gate chose on held-out text) instead of a
//! seeded distribution, each request a contiguous stretch of the recording
//! (`DepthTrace::stream_from_json_file`), under the overlap setting given per trace;
//! `--overlap off,on` runs depth batching with synchronous result reads and with launch N+1
//! issued before N's results are read (`Engine::set_overlap`).
//!
//! Suite `cb`: for each width W, W requests at once (random prompt ids, eos ignored) with the
//! full-depth continuous batching baseline; decode tokens/s (median over repeats, after a
//! warm-up) next to the weight-streaming floor (bytes of weights one decode step reads ÷ the
//! measured device copy bandwidth) and the roofline: per decode step max(bytes read — weights
//! and the K/V each row's attention reads at its actual context — ÷ copy bandwidth, FLOPs ÷ the
//! measured bf16 matmul peak, sustained on random data), and the fraction of it reached. Both suites put `weight_bytes`,
//! `kv_bytes`, `flops`, `roofline_s` and `fraction_of_roofline` into every stage's JSON (suite
//! cdb prints the fractions per stage: core, coda, prefill, decode).
//!
//! Suite `cb --long-prompts L1,L2,…`: long prompts arriving while W − n short requests decode,
//! with the prefill chunked at each `--budgets` value and unchunked; the short requests' decode
//! tokens/s and longest token gap while the long ones prefill, and time to first token (see
//! `long_prompts.rs`).
//!
//! Suite `cdb`: CB vs depth batching without and with refill on one workload per width:
//! `requests-per-width × W` requests with ShareGPT-like lengths (prompt ~ lognormal, median 128,
//! σ 0.9, clipped to 8..512; output ~ lognormal, median 160, σ 0.7, clipped to 8..256; medians
//! and maxima set by `--prompt-median` … `--output-max`, recorded as `workload` in the JSON), exit
//! depths replayed from a seeded distribution over `min-depth..=r_max` with the given mean.
//! Offline throughput over the steady-state window (opens after as many completions as requests
//! can be resident — W, plus the coda reserve — and closes at the last admission or, with
//! `--window-completions`, after that many completions inside it, so every mode covers as much
//! work; the whole run if the window is shorter than 20 % of it), speed-up over CB,
//! the FLOP bound for the realised mean depth, the fraction of the bound achieved, and the GPU
//! idle share: exact with `--time-device` (`idle=`: 1 − device spans ÷ run wall time), else an
//! upper bound over the launches (host time not blocked on the device). With `--repeats N` each
//! configuration runs N times on one engine after its warm-up and the median run is reported
//! (every run's tokens/s is kept in the JSON); by default once. `--time-device` records each
//! launch's device-side span with stream events (`LoopedOptions::time_device`): per stage in the
//! JSON (`device_s`, of it `device_forward_s` in the model's forward, the rest sampling,
//! re-entry and result copies) and printed, exact under overlap where the host's wait is not.
//! `--drain off` aborts the requests still running when the window closes (the drain is outside
//! the window; with long outputs it is much of the run). Stage figures and the idle share cover
//! the window.
//! Each depth-batching row then also gets the prefill-adjusted bound (the paper's realistic
//! ceiling): CB's device time with its decode divided by the FLOP bound and its prefill, full
//! depth in every mode, unchanged; and the share of it reached.
//!
//! Suite `gemm` (`gemm.rs`): the model's decode-width dense products (`--widths` rows, `--repeats`
//! rounds) on cuBLAS, timed issued eagerly and replayed as a CUDA graph, the graph's time as a
//! share of the copy bandwidth; with `--quantization fp8` each layer's FP8 product too, under
//! `--kernels`.
//!
//! `--parity` first compares next-token logits of the bf16 CUDA model with the f32 CPU reference
//! on the same weights. `--quantization fp8` stores the model's linear layers in FP8 (the
//! parity check's too, which then measures FP8's logit error; the roofline counts the bytes as
//! stored). `--tiny` runs a tiny config on the CPU (a smoke test of this binary).

mod cb;
mod cdb;
mod gemm;
mod long_prompts;
mod parity;

use candle_core::{DType, Device};
use ponder::bench::Lengths;
use ponder::loader::Weights;
use ponder::looped::models::{Huginn, Ouro};
use ponder::looped::models::{HuginnConfig, LoopedModel, OuroConfig};
use ponder::testing::{huginn_tensor_manifest, ouro_tensor_manifest, random_tensors, tiny_huginn_config, tiny_ouro_config};
use ponder::KvLayoutKind;
use std::time::Instant;

pub(crate) struct Args {
    pub(crate) widths: Vec<usize>,
    pub(crate) prompt_len: usize,
    pub(crate) new_tokens: usize,
    pub(crate) repeats: usize,
    /// Whether `--repeats` was given (suite cdb runs each configuration once unless it was).
    pub(crate) repeats_set: bool,
    pub(crate) layout: KvLayoutKind,
    pub(crate) json: Option<String>,
    pub(crate) commit: String,
    pub(crate) parity: bool,
    pub(crate) tiny: bool,
    pub(crate) suite: String,
    pub(crate) mean_depths: Vec<f64>,
    /// Suite cdb: recorded depth traces `LABEL=FILE[:on|off]` instead of `mean_depths`.
    pub(crate) depth_traces: Vec<String>,
    pub(crate) modes: Vec<String>,
    pub(crate) requests_per_width: usize,
    pub(crate) min_depth: usize,
    pub(crate) kv_gb: f64,
    /// Every engine's kernel choices (`--kernels`, as `KernelPolicy`'s `FromStr` reads them).
    pub(crate) kernels: ponder::kernels::KernelPolicy,
    /// How the model's linear layers are stored (`--quantization fp8`; the parity check's
    /// device model too).
    pub(crate) quantization: ponder::quant::Quantization,
    pub(crate) model: String,
    pub(crate) min_coda: Vec<String>,
    /// Coda reserves to compare (refill only): numbers, or "parked" for min coda − 1.
    pub(crate) coda_reserve: Vec<String>,
    /// Explicit (min coda, reserve) pairs for refill, instead of the cross product.
    pub(crate) coda_pairs: Vec<String>,
    pub(crate) lengths: Lengths,
    pub(crate) overlap: Vec<bool>,
    /// Record each launch's device-side span (stream events) into the per-stage JSON.
    pub(crate) time_device: bool,
    /// Run each workload to its end (`--drain on`, the default) or abort what is still running
    /// when the steady-state window closes (`--drain off`).
    pub(crate) drain: bool,
    /// Completions after which the steady-state window closes (else at the last admission).
    pub(crate) window_completions: Option<PerWidth>,
    /// Suite cb: long prompts that arrive while short requests decode (empty: the plain suite).
    pub(crate) long_prompts: Vec<usize>,
    /// Chunked-prefill budgets to compare with the unchunked run.
    pub(crate) budgets: Vec<usize>,
    /// Milliseconds between two long arrivals.
    pub(crate) arrival_gap: usize,
    /// Suite cb: after each width, one decode step inside a CUDA profiler range (for
    /// `ncu --profile-from-start off`).
    pub(crate) profile_step: bool,
}

/// A count given as a number or as a multiple of the width (`2w`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum PerWidth {
    Fixed(usize),
    TimesWidth(f64),
}

impl PerWidth {
    pub(crate) fn of(self, width: usize) -> usize {
        match self {
            Self::Fixed(n) => n,
            Self::TimesWidth(x) => (x * width as f64).round() as usize,
        }
    }
}

impl std::str::FromStr for PerWidth {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s} is neither a count nor a multiple of the width such as 2w");
        match s.strip_suffix('w') {
            Some("") => Ok(Self::TimesWidth(1.0)),
            Some(x) => x.parse().map(Self::TimesWidth).map_err(|_| bad()),
            None => s.parse().map(Self::Fixed).map_err(|_| bad()),
        }
    }
}

fn parse() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        widths: vec![16, 64, 256],
        prompt_len: 128,
        new_tokens: 256,
        repeats: 3,
        repeats_set: false,
        layout: KvLayoutKind::DepthIndexed,
        json: None,
        commit: "unknown".into(),
        parity: false,
        tiny: false,
        suite: "cb".into(),
        mean_depths: vec![2.5, 3.0],
        depth_traces: Vec::new(),
        modes: vec!["cb".into(), "cdb-no-refill".into(), "cdb-refill".into()],
        requests_per_width: 3,
        min_depth: 2,
        kv_gb: 40.0,
        kernels: ponder::kernels::KernelPolicy::default(),
        quantization: ponder::quant::Quantization::None,
        model: "ouro".into(),
        min_coda: vec!["1".into()],
        coda_reserve: vec!["0".into()],
        coda_pairs: Vec::new(),
        lengths: Lengths::default(),
        overlap: vec![false],
        time_device: false,
        drain: true,
        window_completions: None,
        long_prompts: Vec::new(),
        budgets: vec![2048, 8192],
        arrival_gap: 150,
        profile_step: false,
    };
    let mut layout_set = false;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--widths" => a.widths = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--prompt-len" => a.prompt_len = v()?.parse()?,
            "--new-tokens" => a.new_tokens = v()?.parse()?,
            "--repeats" => {
                a.repeats = v()?.parse()?;
                a.repeats_set = true;
            }
            "--layout" => {
                a.layout = v()?.parse()?;
                layout_set = true;
            }
            "--suite" => a.suite = v()?,
            "--mean-depths" => a.mean_depths = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--depth-traces" => a.depth_traces = v()?.split(',').map(String::from).collect(),
            "--modes" => a.modes = v()?.split(',').map(String::from).collect(),
            "--requests-per-width" => a.requests_per_width = v()?.parse()?,
            "--min-depth" => a.min_depth = v()?.parse()?,
            "--kv-gb" => a.kv_gb = v()?.parse()?,
            "--kernels" => a.kernels = v()?.parse()?,
            "--quantization" => a.quantization = v()?.parse()?,
            "--model" => a.model = v()?,
            "--min-coda" => a.min_coda = v()?.split(',').map(String::from).collect(),
            "--coda-reserve" => a.coda_reserve = v()?.split(',').map(String::from).collect(),
            "--coda-pairs" => a.coda_pairs = v()?.split(',').map(String::from).collect(),
            "--prompt-median" => a.lengths.prompt_median = v()?.parse()?,
            "--prompt-max" => a.lengths.prompt_max = v()?.parse()?,
            "--output-median" => a.lengths.output_median = v()?.parse()?,
            "--output-max" => a.lengths.output_max = v()?.parse()?,
            "--overlap" => a.overlap = v()?.split(',').map(on_off).collect::<Result<_, _>>()?,
            "--time-device" => a.time_device = true,
            "--drain" => a.drain = on_off(&v()?)?,
            "--window-completions" => a.window_completions = Some(v()?.parse()?),
            "--long-prompts" => a.long_prompts = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--budgets" => a.budgets = v()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--arrival-gap-ms" => a.arrival_gap = v()?.parse()?,
            "--profile-step" => a.profile_step = true,
            "--json" => a.json = Some(v()?),
            "--commit" => a.commit = v()?,
            "--parity" => a.parity = true,
            "--tiny" => a.tiny = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if a.suite == "cdb" && !layout_set {
        a.layout = KvLayoutKind::Shared; // the CDB default layout; valid for every exit depth
    }
    Ok(a)
}

/// A switch value: on / off (or true / false).
fn on_off(x: &str) -> Result<bool, String> {
    match x {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        other => Err(format!("expected on or off, not {other}")),
    }
}

/// The benchmarked model: real shapes (or a tiny CPU config), random weights.
#[derive(Clone)]
pub(crate) enum BenchModel {
    Ouro(Ouro),
    Huginn(Huginn),
}

impl BenchModel {
    fn boxed(&self) -> Box<dyn LoopedModel> {
        match self {
            Self::Ouro(m) => Box::new(m.clone()),
            Self::Huginn(m) => Box::new(m.clone()),
        }
    }
    fn device(&self) -> &ponder::Device {
        match self {
            Self::Ouro(m) => m.device(),
            Self::Huginn(m) => m.device(),
        }
    }
    fn spec(&self) -> &ponder::looped::models::LoopedSpec {
        match self {
            Self::Ouro(m) => m.spec(),
            Self::Huginn(m) => m.spec(),
        }
    }
}

/// Builds the benchmarked model from its weights.
type LoadFn = Box<dyn Fn(&Weights) -> ponder::Result<BenchModel>>;

/// How to make the benchmarked model from a set of weights.
pub(crate) struct ModelRecipe {
    pub(crate) name: &'static str,
    pub(crate) manifest: Vec<(String, Vec<usize>)>,
    pub(crate) load: LoadFn,
}

fn recipe(model: &str, tiny: bool) -> Result<ModelRecipe, Box<dyn std::error::Error>> {
    Ok(match (model, tiny) {
        ("ouro", false) | ("ouro", true) => {
            let cfg = if tiny { tiny_ouro_config(512) } else { OuroConfig::ouro_1_4b() };
            ModelRecipe {
                name: if tiny { "tiny-ouro (random)" } else { "Ouro-1.4B shapes, random bf16 weights" },
                manifest: ouro_tensor_manifest(&cfg),
                load: Box::new(move |w| Ok(BenchModel::Ouro(Ouro::load(&cfg, w)?))),
            }
        }
        ("huginn", _) => {
            let cfg = if tiny { tiny_huginn_config(512) } else { HuginnConfig::huginn_0125() };
            ModelRecipe {
                name: if tiny { "tiny-huginn (random)" } else { "Huginn-0125 (3.5B) shapes, r_max 16, random bf16 weights" },
                manifest: huginn_tensor_manifest(&cfg),
                load: Box::new(move |w| Ok(BenchModel::Huginn(Huginn::load(&cfg, w)?))),
            }
        }
        (other, _) => return Err(format!("unknown model {other} (ouro | huginn)").into()),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    let (device, dtype) = if args.tiny { (Device::Cpu, DType::F32) } else { (Device::new_cuda(0)?, DType::BF16) };
    let recipe = recipe(&args.model, args.tiny)?;
    let gpu = ponder::bench::gpu_name();
    println!("device: {gpu}; model: {}", recipe.name);
    if args.suite == "gemm" {
        // The layers' shapes only: no model is made.
        let bandwidth = ponder::bench::device_peak::copy_bandwidth(&device)?;
        println!("copy bandwidth {:.0} GB/s", bandwidth / 1e9);
        // The suite's kernels as `--kernels` sets them (the split plan, the FP8 kernels).
        let run = || gemm::gemm_suite(&args.model, &args.widths, args.repeats, &device, bandwidth, args.quantization);
        let results = ponder::ops::with_kernels(args.kernels, run).0?;
        if let Some(path) = &args.json {
            let doc = serde_json::json!({
                "gpu": gpu, "commit": args.commit, "command": std::env::args().collect::<Vec<_>>().join(" "),
                "model": recipe.name, "suite": "gemm", "kernels": format!("{:?}", args.kernels), "quantization": format!("{:?}", args.quantization),
                "copy_bandwidth_gb_s": bandwidth / 1e9, "results": results,
            });
            std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
            println!("wrote {path}");
        }
        return Ok(());
    }

    let mut parity_json = serde_json::Value::Null;
    if args.parity {
        parity_json = ponder::ops::with_kernels(args.kernels, || parity::parity(&recipe, &device, dtype, args.quantization)).0?;
    }

    let t = Instant::now();
    let master = random_tensors(&recipe.manifest, 7, dtype, &device)?;
    let model = (recipe.load)(&Weights::from_map(master, dtype, &device).with_quantization(args.quantization))?;
    device.synchronize()?;
    println!("random weights generated on the device in {:.1}s", t.elapsed().as_secs_f64());
    let spec = model.spec().clone();
    let weight_bytes_per_step = spec.max_steps as u64 * spec.step_bytes + spec.boundary_bytes;
    let bandwidth = ponder::bench::device_peak::copy_bandwidth(&device)?;
    let peak = ponder::bench::device_peak::matmul_peak(&device)?;
    let roof = Roof { bandwidth, peak: peak.sustained };
    println!("copy bandwidth {:.0} GB/s; bf16 matmul peak {peak}; weights read per decode step {:.2} GB", bandwidth / 1e9, weight_bytes_per_step as f64 / 1e9);

    let results = if args.suite == "cdb" {
        cdb::cdb_suite(&args, &model, roof)?
    } else if !args.long_prompts.is_empty() {
        long_prompts::long_prompt_suite(&args, &model)?
    } else {
        cb::cb_suite(&args, &model, roof, weight_bytes_per_step)?
    };
    if let Some(path) = &args.json {
        let mut doc = serde_json::json!({
            "gpu": gpu, "commit": args.commit,
            "command": std::env::args().collect::<Vec<_>>().join(" "), "kernels": format!("{:?}", args.kernels),
            "quantization": format!("{:?}", args.quantization),
            "model": recipe.name,
            "suite": args.suite, "layout": format!("{:?}", args.layout),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "workload": if args.suite == "cdb" { args.lengths.json() } else { serde_json::Value::Null },
            "drain": args.drain, "window_completions": args.window_completions.map(|k| format!("{k:?}")),
            "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes_per_decode_step": weight_bytes_per_step,
            "f0_over_fr": spec.boundary_params as f64 / spec.step_params as f64,
            "parity": parity_json, "results": results,
        });
        let fields = doc.as_object_mut().expect("a JSON object");
        fields.extend(peak.json_fields().map(|(k, v)| (k.to_string(), v.into())));
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        println!("wrote {path}");
    }
    Ok(())
}

/// What the device can do at best, measured: copy bandwidth (bytes/s) and bf16 matmul peak
/// (FLOP/s).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Roof {
    pub(crate) bandwidth: f64,
    pub(crate) peak: f64,
}

impl Roof {
    /// Adds `roofline_s` (max of bytes ÷ bandwidth and FLOPs ÷ peak) and `fraction_of_roofline`
    /// (it ÷ the stage's device time, else its wall time) to every stage of a stages JSON, and
    /// returns "stage NN%" parts for printing.
    pub(crate) fn annotate(&self, stages: &mut serde_json::Value) -> Vec<String> {
        let mut parts = Vec::new();
        for (name, v) in stages.as_object_mut().into_iter().flatten() {
            let bytes = v["weight_bytes"].as_f64().unwrap_or(0.0) + v["kv_bytes"].as_f64().unwrap_or(0.0);
            let roof = (bytes / self.bandwidth).max(v["flops"].as_f64().unwrap_or(0.0) / self.peak);
            let Some(time) = v["device_s"].as_f64().or(v["seconds"].as_f64()).filter(|t| *t > 0.0) else {
                continue;
            };
            v["roofline_s"] = roof.into();
            v["fraction_of_roofline"] = (roof / time).into();
            parts.push(format!("{name} {:.0}%", 100.0 * roof / time));
        }
        parts
    }
}
