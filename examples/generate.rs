//! Streams text from a model directory (default: the shipped tiny Ouro in `assets/`).
//!
//!     cargo run --release --example generate -- "Ownership in Rust"
//!     cargo run --release --example generate -- --max-new 64 --temperature 0.8 --top-p 0.9 --seed 1 "Traits"
//!     cargo run --release --example generate -- --sdar --threshold 0.7 "Ownership in Rust"
//!     cargo run --release --example generate -- --chat      # multi-turn: one user turn per stdin line
//!     cargo run --release --example generate -- --gate lookahead --q 0.5 "Traits"
//!
//! Options: --model DIR, --max-new N, --temperature T, --top-k K, --top-p P, --seed S,
//! --layout depth-indexed|shared, --cuda, --bf16, --tp N (tensor parallelism: N GPUs, or N threads on the CPU),
//! --quantization fp8 (projections and MLPs in E4M3), --kernels POLICY (e.g. `fp8=w8a8`). Diffusion models (`--sdar` / `--llada` pick the shipped
//! tiny SDAR / LLaDA): --threshold T (reveal tokens with probability ≥ T each step, default 0.9),
//! --block-length N, --delayed-cache. Several prompts run as one batch, each streamed on its
//! own thread through an `EngineHandle`. `--chat` reads the user's turns from stdin, one per
//! line, and renders the conversation so far with the model's chat template each turn
//! (`--system TEXT` opens it with a system message).
//!
//! Exit gates (looped models; continuous depth batching with the last-exited KV layout unless
//! `--layout` says otherwise): `--gate stock` (the checkpoint's own gate, synchronous),
//! `delayed` (the stock gate's verdict one step late, with overlap), `lookahead` (the trained
//! lookahead head, with overlap) or `preloop` (the trained preloop head: the depth picked from
//! the token before the loop, with overlap); `--q Q` is the exit threshold (default 0.5). The
//! trained heads are read from the model directory (`lookahead_exit_gate.safetensors`,
//! `preloop_exit_gate.safetensors`; `tools/train/train_gate.py` writes them). A single prompt
//! ends with the mean loop depth its tokens ran.

use ponder::chat::{Chat, ChatMessage};

use ponder::diffusion::Threshold;
use ponder::{DType, Device, EngineBuilder, Event, GenerationParams, KvLayoutKind, SamplingParams};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut model = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro").to_string();
    let mut params = GenerationParams::greedy(48);
    let mut sampling = SamplingParams::default();
    let (mut layout, mut cuda, mut bf16) = (None::<KvLayoutKind>, false, false);
    let (mut threshold, mut block_length, mut delayed) = (None::<f32>, None::<usize>, false);
    let mut prompts = Vec::new();
    let (mut chat, mut system) = (false, None::<String>);
    let (mut gate, mut q) = (None::<String>, 0.5f32);
    let mut tp = 1usize;
    let (mut quantization, mut kernels) = (ponder::quant::Quantization::None, ponder::kernels::KernelPolicy::default());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--model" => model = val()?,
            "--max-new" => params.max_new_tokens = val()?.parse()?,
            "--temperature" => sampling.temperature = val()?.parse()?,
            "--top-k" => sampling.top_k = Some(val()?.parse()?),
            "--top-p" => sampling.top_p = Some(val()?.parse()?),
            "--seed" => sampling.seed = Some(val()?.parse()?),
            "--layout" => layout = Some(val()?.parse()?),
            "--sdar" => model = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-sdar").to_string(),
            "--llada" => model = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-llada").to_string(),
            "--threshold" => threshold = Some(val()?.parse()?),
            "--block-length" => block_length = Some(val()?.parse()?),
            "--delayed-cache" => delayed = true,
            "--chat" => chat = true,
            "--system" => system = Some(val()?),
            "--gate" => gate = Some(val()?),
            "--q" => q = val()?.parse()?,
            "--cuda" => cuda = true,
            "--bf16" => bf16 = true,
            "--tp" => tp = val()?.parse()?,
            "--quantization" => quantization = val()?.parse()?,
            "--kernels" => kernels = val()?.parse()?,
            "-h" | "--help" => {
                println!("usage: generate [--model DIR | --sdar | --llada] [--max-new N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--layout L] [--threshold T] [--block-length N] [--delayed-cache] [--chat [--system TEXT]] [--gate stock|delayed|lookahead|preloop [--q Q]] [--cuda] [--bf16] [--tp N] [--quantization fp8] [--kernels POLICY] PROMPT...");
                return Ok(());
            }
            _ => prompts.push(a),
        }
    }
    if prompts.is_empty() {
        prompts.push("The borrow checker".into());
    }
    params.sampling = sampling;
    let device = if cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let mut builder =
        EngineBuilder::new(&model).device(device).dtype(if bf16 { DType::BF16 } else { DType::F32 }).max_num_seqs(prompts.len().max(1)).tensor_parallel(tp);
    builder = builder.quantization(quantization).kernels(kernels);
    if let Some(l) = layout {
        builder = builder.looped(|o| o.kv_layout(l));
    }
    if let Some(name) = &gate {
        let (gate, overlap) = ponder::looped::gate::ouro_gate(std::path::Path::new(&model), name, q)?;
        let layout = layout.unwrap_or(KvLayoutKind::LastExited);
        builder = builder.looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).kv_layout(layout).exit_gate_boxed(gate).overlap(overlap));
    }
    if let Some(t) = threshold {
        let policy = Threshold::new(t)?;
        builder = builder.diffusion(|o| o.unmask_policy(policy));
    }
    if let Some(n) = block_length {
        builder = builder.diffusion(|o| o.block_length(n));
    }
    if delayed {
        builder = builder.diffusion(|o| o.delayed_cache(true));
    }
    let handle = builder.spawn()?;
    if chat {
        return converse(&handle, params, system);
    }

    if prompts.len() == 1 {
        // One prompt: stream straight to the terminal.
        let stream = handle.submit(prompts[0].as_str(), params)?;
        print!("{}", prompts[0]);
        let (mut steps, mut tokens) = (0u64, 0u64);
        for ev in stream {
            match ev {
                Event::Token { text, compute, .. } => {
                    print!("{text}");
                    if let Some(ponder::TokenCompute::LoopSteps(n)) = compute {
                        steps += u64::from(n);
                    }
                    tokens += 1;
                }
                Event::Finished { text, reason, .. } => {
                    let depth = if gate.is_some() && tokens > 0 { format!(", mean depth {:.2}", steps as f64 / tokens as f64) } else { String::new() };
                    println!("{text}\n[finished: {reason:?}{depth}]")
                }
            }
            std::io::stdout().flush()?;
        }
        return Ok(());
    }
    // Several prompts: one thread per request, outputs printed as each completes.
    std::thread::scope(|s| {
        for p in &prompts {
            let stream = handle.submit(p.as_str(), params.clone());
            s.spawn(move || match stream {
                Ok(stream) => {
                    let out = stream.collect_output();
                    println!("--- {p}{}\n[finished: {:?}, {} tokens]", out.text, out.finish_reason, out.token_ids.len());
                }
                Err(e) => eprintln!("--- {p}: {e}"),
            });
        }
    });
    Ok(())
}

/// A conversation on stdin: each line is the user's turn; the reply streams, then joins the
/// history that the next turn's prompt is rendered from.
fn converse(handle: &ponder::EngineHandle, params: GenerationParams, system: Option<String>) -> Result<(), Box<dyn std::error::Error>> {
    let mut messages: Vec<ChatMessage> = system.into_iter().map(ChatMessage::system).collect();
    for line in std::io::stdin().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        println!("> {line}");
        messages.push(ChatMessage::user(line));
        let stream = handle.submit(Chat::new(messages.clone()), params.clone())?;
        let mut reply = String::new();
        for ev in stream {
            match ev {
                Event::Token { text, .. } => {
                    print!("{text}");
                    reply.push_str(&text);
                }
                Event::Finished { text, reason, .. } => {
                    reply.push_str(&text);
                    println!("{text}\n[finished: {reason:?}]");
                }
            }
            std::io::stdout().flush()?;
        }
        messages.push(ChatMessage::assistant(reply.trim()));
    }
    Ok(())
}
