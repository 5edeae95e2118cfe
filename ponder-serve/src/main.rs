//! `ponder-serve`: an OpenAI-compatible server for one model.
//!
//!     cargo run --release -p ponder-serve                        # the tiny Ouro, CPU, 127.0.0.1:8000
//!     cargo run --release -p ponder-serve -- --model assets/tiny-sdar --port 8080
//!     cargo run --release -p ponder-serve --features hub -- --model owner/name   # from the hub

use clap::Parser;
use ponder::config::ModelConfig;
use ponder::loader::ModelDir;
use ponder::{DType, Device, EngineBuilder};
use ponder_serve::{router, AppState, Defaults, Limits};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(about = "An OpenAI-compatible HTTP server for a Ponder engine")]
struct Args {
    /// A checkpoint directory (config.json, safetensors, tokenizer.json), or — a build with
    /// `--features hub` — a hub repository `owner/name` that is no directory here, downloaded
    /// into the hub cache.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny-ouro"))]
    model: PathBuf,
    /// The hub `--model owner/name` comes from (default: `HF_ENDPOINT`, else huggingface.co).
    #[cfg(feature = "hub")]
    #[arg(long)]
    hub_endpoint: Option<String>,
    /// The hub cache to download into (default: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`).
    #[cfg(feature = "hub")]
    #[arg(long)]
    hub_cache: Option<PathBuf>,
    /// The model id clients name (default: the directory's name, or the hub repository).
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Run on CUDA device 0 (a build with `--features cuda`).
    #[arg(long)]
    cuda: bool,
    /// bf16 weights and activations (default f32 on the CPU, bf16 on CUDA).
    #[arg(long)]
    bf16: bool,
    /// `fp8`: attention projections and MLPs in E4M3 with a scale per output channel,
    /// quantized at load (a checkpoint shipped in FP8 is served in FP8 without it).
    #[arg(long)]
    quantization: Option<String>,
    /// Kernel choices as `key=value` pairs (`ponder::kernels::KernelPolicy`), e.g.
    /// `fp8=by-shape`: FP8 layers through the weight-only kernel at decode widths and W8A8 on
    /// the FP8 tensor cores above (default: the dequantized weight).
    #[arg(long)]
    kernels: Option<String>,
    /// Split the model over N devices (tensor parallelism): N GPUs from GPU 0 with `--cuda`
    /// (joined by NCCL), N threads on the CPU. Heads and MLP widths must divide by N.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// With `--tp`, split a mixture-of-experts model's routed experts over the ranks whole
    /// instead of every expert's columns.
    #[arg(long)]
    expert_parallel: bool,
    /// Most requests decoding at once.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Most prompt tokens one prefill launch holds.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Share of free device memory the KV pool takes.
    #[arg(long)]
    kv_memory_fraction: Option<f64>,
    /// Looped models: `cb` (full depth), `cdb` (continuous depth batching with refill) or
    /// `cdb-no-refill`. An exit gate implies `cdb`.
    #[arg(long)]
    scheduler: Option<String>,
    /// Looped models: the KV layout (`depth-indexed`, `last-exited`, `shared`, `first-then-shared`;
    /// with an exit gate, `last-exited` unless named).
    #[arg(long)]
    layout: Option<ponder::KvLayoutKind>,
    /// Ouro: the exit gate (`stock`, `delayed`, `lookahead`, `preloop`), at `--q`; the last
    /// three serve with overlap.
    #[arg(long)]
    gate: Option<String>,
    /// The exit gate's threshold on the exit CDF.
    #[arg(long, default_value_t = 0.5)]
    q: f32,
    /// Diffusion models: reveal tokens whose confidence reaches this (default: the model's).
    #[arg(long)]
    threshold: Option<f32>,
    /// Diffusion models: the decoding block length.
    #[arg(long)]
    block_length: Option<usize>,
    /// Diffusion models: the delayed cache.
    #[arg(long)]
    delayed_cache: bool,
    /// Diffusion models: FOCUS token eviction at this α (e.g. 1.5).
    #[arg(long)]
    focus: Option<f32>,
    /// Chat completions that name no token limit stop after this many tokens.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: u64,
    /// The temperature of requests that name none (default: OpenAI's 1 for looped models, 0 for
    /// diffusion models, whose releases are evaluated greedy).
    #[arg(long)]
    default_temperature: Option<f32>,
    /// Requests that may wait for admission beyond the `max_num_seqs` running; one more is
    /// answered 429 with `Retry-After`.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// End a request still generating after this many seconds (504, or an error event on a
    /// stream), and abort it.
    #[arg(long)]
    request_timeout: Option<f64>,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let mut a = Args::parse();
    let (model, model_name) = open_model(&a)?;
    // From here on the model is its directory (a hub repository's snapshot in the cache).
    a.model = model.path.clone();
    let looped = matches!(model.config, ModelConfig::Ouro(_) | ModelConfig::Huginn(_));
    let mut b = EngineBuilder::new(&a.model);
    if a.cuda {
        b = b.device(Device::new_cuda(0)?).dtype(DType::BF16);
    }
    if a.bf16 {
        b = b.dtype(DType::BF16);
    }
    if let Some(q) = &a.quantization {
        b = b.quantization(q.parse()?);
    }
    if let Some(k) = &a.kernels {
        b = b.kernels(k.parse()?);
    }
    b = b.tensor_parallel(a.tp).expert_parallel(a.expert_parallel);
    if let Some(n) = a.max_num_seqs {
        b = b.max_num_seqs(n);
    }
    if let Some(n) = a.max_num_batched_tokens {
        b = b.max_num_batched_tokens(n);
    }
    if let Some(f) = a.kv_memory_fraction {
        b = b.kv_memory_fraction(f);
    }
    b = engine_options(b, &a)?;
    let name = a.served_model_name.clone().unwrap_or(model_name);
    let defaults = Defaults { model: name, max_tokens: a.default_max_tokens, temperature: a.default_temperature.unwrap_or(if looped { 1.0 } else { 0.0 }) };
    let running = a.max_num_seqs.unwrap_or(ponder::scheduler::SchedulerLimits::default().max_num_seqs);
    let limits = Limits {
        max_in_flight: running.saturating_add(a.max_waiting),
        request_timeout: a.request_timeout.filter(|t| *t > 0.0).map(std::time::Duration::from_secs_f64),
    };
    let state = Arc::new(AppState::new(b.spawn()?, defaults, limits));
    let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port)).await?;
    eprintln!("serving `{}` on http://{}", state.defaults.model, listener.local_addr()?);
    axum::serve(listener, router(state, a.max_body_bytes)).with_graceful_shutdown(shutdown()).await?;
    Ok(())
}

/// The checkpoint `--model` names and the model id it is served as by default: a directory and
/// its name, or (the `hub` feature) a hub repository `owner/name` that is no directory here,
/// downloaded into the cache, and its id.
fn open_model(a: &Args) -> Result<(ModelDir, String), Box<dyn std::error::Error>> {
    let repo = hub_repo(&a.model);
    #[cfg(feature = "hub")]
    if let Some(repo) = repo {
        let options = ponder::loader::HubOptions { endpoint: a.hub_endpoint.clone(), cache_dir: a.hub_cache.clone(), ..Default::default() };
        eprintln!("fetching `{repo}` from the hub");
        return Ok((ModelDir::from_hub_with(repo, &options)?, repo.to_string()));
    }
    #[cfg(not(feature = "hub"))]
    if let Some(repo) = repo {
        return Err(format!("--model {repo}: no such directory (a hub repository needs a build with `--features hub`)").into());
    }
    let model = ModelDir::open(&a.model)?;
    let canonical = a.model.canonicalize().unwrap_or_else(|_| a.model.clone());
    let name = canonical.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
    Ok((model, name))
}

/// `model` as a hub repository id: `owner/name` of letters, digits, `-`, `_` and `.`, and no
/// directory here.
fn hub_repo(model: &Path) -> Option<&str> {
    let s = model.to_str()?;
    let (owner, name) = s.split_once('/')?;
    let part = |p: &str| !p.is_empty() && !p.starts_with('.') && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    (part(owner) && part(name) && !model.exists()).then_some(s)
}

/// The family options the flags ask for; each family ignores the other's (`EngineBuilder`
/// refuses options of the wrong family, so only the flags given are set).
fn engine_options(mut b: EngineBuilder, a: &Args) -> Result<EngineBuilder, Box<dyn std::error::Error>> {
    use ponder::SchedulerKind;
    let scheduler = match (a.scheduler.as_deref(), a.gate.is_some()) {
        (None, false) => None,
        (Some("cb"), false) => Some(SchedulerKind::Continuous),
        (None | Some("cdb"), _) => Some(SchedulerKind::Depth { refill: true }),
        (Some("cdb-no-refill"), _) => Some(SchedulerKind::Depth { refill: false }),
        (Some(other), _) => return Err(format!("--scheduler {other}: cb, cdb or cdb-no-refill (an exit gate needs cdb)").into()),
    };
    if let Some(kind) = scheduler {
        b = b.looped(|o| o.scheduler(kind));
    }
    // A gate exits before full depth, which the depth-indexed default cannot serve.
    if let Some(layout) = a.layout.or(a.gate.as_ref().map(|_| ponder::KvLayoutKind::LastExited)) {
        b = b.looped(|o| o.kv_layout(layout));
    }
    if let Some(name) = &a.gate {
        let (gate, overlap) = ponder::looped::gate::ouro_gate(&a.model, name, a.q)?;
        b = b.looped(|o| o.exit_gate_boxed(gate).overlap(overlap));
    }
    if let Some(t) = a.threshold {
        let policy = ponder::diffusion::Threshold::new(t)?;
        b = b.diffusion(|o| o.unmask_policy(policy));
    }
    if let Some(n) = a.block_length {
        b = b.diffusion(|o| o.block_length(n));
    }
    if a.delayed_cache {
        b = b.diffusion(|o| o.delayed_cache(true));
    }
    if let Some(alpha) = a.focus {
        let focus = ponder::diffusion::Focus::new(alpha)?;
        b = b.diffusion(|o| o.delayed_cache(true).eviction_policy(focus));
    }
    Ok(b)
}

/// SIGINT or SIGTERM: stop accepting, let the streams in flight finish, exit 0.
async fn shutdown() {
    let term = async {
        #[cfg(unix)]
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
            return;
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
