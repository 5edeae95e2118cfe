//! What the HTTP path costs: the same workload through the server (streaming SSE clients on
//! loopback) and through the in-process `EngineHandle`, on one engine, alternated A/B/A/B.
//!
//!     cargo run --release -p ponder-serve --example bench_serve                 # tiny Ouro, CPU
//!     cargo run --release -p ponder-serve --example bench_serve -- --clients 64 --requests 256 \
//!         --max-tokens 64 --rounds 2 --json /tmp/serve.json [--model DIR | --ouro-1.4b] [--cuda]
//!
//! `--ouro-1.4b`: Ouro-1.4B shapes with random bf16 weights generated on the device (no
//! checkpoint needed). Prompts are token ids, the same in both paths.
//!
//! Prints tokens/s of each run, the server's share of the in-process rate, and the HTTP path's
//! cost per token (the wall-time difference over the tokens).

use futures_util::StreamExt;
use ponder::{DType, Device, EngineBuilder, GenerationParams};
use ponder_serve::{router, AppState, Defaults, Limits};
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Instant;

struct Args {
    model: String,
    ouro_1_4b: bool,
    cuda: bool,
    clients: usize,
    requests: usize,
    max_tokens: usize,
    rounds: usize,
    json: Option<String>,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        model: concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny-ouro").into(),
        ouro_1_4b: false,
        cuda: false,
        clients: 64,
        requests: 256,
        max_tokens: 32,
        rounds: 2,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut v = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = v()?,
            "--cuda" => a.cuda = true,
            "--ouro-1.4b" => a.ouro_1_4b = true,
            "--clients" => a.clients = v()?.parse()?,
            "--requests" => a.requests = v()?.parse()?,
            "--max-tokens" => a.max_tokens = v()?.parse()?,
            "--rounds" => a.rounds = v()?.parse()?,
            "--json" => a.json = Some(v()?),
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    Ok(a)
}

/// The prompt of request `i`: 24 token ids, distinct per request, the same in both paths.
fn prompt(i: usize) -> Vec<u32> {
    (0..24).map(|k| ((i * 31 + k * 7) % 500 + 10) as u32).collect()
}

/// Every request through the handle, `clients` threads each draining its requests' streams.
fn in_process(state: &AppState, a: &Args) -> (f64, usize) {
    let started = Instant::now();
    let tokens: usize = std::thread::scope(|s| {
        let workers: Vec<_> = (0..a.clients)
            .map(|c| {
                s.spawn(move || {
                    let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(a.max_tokens) };
                    (c..a.requests)
                        .step_by(a.clients)
                        .map(|i| state.engine.submit(prompt(i), params.clone()).unwrap().collect_output().token_ids.len())
                        .sum::<usize>()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    (started.elapsed().as_secs_f64(), tokens)
}

/// Every request through the server, `clients` tasks each streaming its requests.
async fn over_http(base: &str, a: &Args) -> (f64, usize) {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let tasks: Vec<_> = (0..a.clients)
        .map(|c| {
            let (client, base, ids) = (client.clone(), base.to_string(), (c..a.requests).step_by(a.clients).collect::<Vec<_>>());
            let max_tokens = a.max_tokens;
            tokio::spawn(async move {
                let mut tokens = 0;
                for i in ids {
                    let body = serde_json::json!({"model": "bench", "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true});
                    let mut events = client.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap().bytes_stream();
                    let mut text = Vec::new();
                    while let Some(chunk) = events.next().await {
                        text.extend_from_slice(&chunk.unwrap());
                    }
                    // One chunk per token carries its loop steps.
                    tokens += String::from_utf8_lossy(&text).matches("\"loop_steps\"").count();
                }
                tokens
            })
        })
        .collect();
    let mut tokens = 0;
    for t in tasks {
        tokens += t.await.unwrap();
    }
    (started.elapsed().as_secs_f64(), tokens)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let device = if a.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let engine = if a.ouro_1_4b {
        let cfg = ponder::looped::models::OuroConfig::ouro_1_4b();
        let weights = ponder::testing::random_ouro_weights(&cfg, 7, DType::BF16, &device)?;
        let model = ponder::looped::models::Ouro::load(&cfg, &weights)?;
        EngineBuilder::from_model(Box::new(model), None, vec![]).max_num_seqs(a.clients).spawn()?
    } else {
        let b = EngineBuilder::new(&a.model).max_num_seqs(a.clients).device(device);
        if a.cuda { b.dtype(DType::BF16) } else { b }.spawn()?
    };
    let defaults = Defaults { model: "bench".into(), max_tokens: a.max_tokens as u64, temperature: 0.0 };
    let state = Arc::new(AppState::new(engine, defaults, Limits { max_in_flight: usize::MAX, request_timeout: None }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(axum::serve(listener, router(state.clone(), 1 << 20)).into_future());
    let model = if a.ouro_1_4b { "Ouro-1.4B shapes, random bf16 weights".to_string() } else { a.model.clone() };
    println!("{} requests × {} tokens, {} concurrent clients, {model}", a.requests, a.max_tokens, a.clients);
    // A warm-up of each path, then alternated rounds.
    let warm = Args { requests: a.clients, ..Args { model: String::new(), json: None, ..a } };
    let st = state.clone();
    tokio::task::spawn_blocking(move || in_process(&st, &warm)).await?;
    let mut runs = Vec::new();
    for round in 1..=a.rounds {
        let st = state.clone();
        let ab = Args { model: String::new(), json: None, ..a };
        let (t_in, n_in) = tokio::task::spawn_blocking(move || in_process(&st, &ab)).await?;
        let (t_http, n_http) = over_http(&base, &a).await;
        let (r_in, r_http) = (n_in as f64 / t_in, n_http as f64 / t_http);
        println!(
            "round {round}: in-process {r_in:.0} tok/s, server {r_http:.0} tok/s ({:.1} % of in-process), HTTP path {:+.1} µs/token",
            100.0 * r_http / r_in,
            1e6 * (t_http / n_http as f64 - t_in / n_in as f64)
        );
        runs.push(serde_json::json!({"round": round, "in_process_tokens_per_s": r_in, "server_tokens_per_s": r_http, "in_process_tokens": n_in, "server_tokens": n_http,
                                     "in_process_s": t_in, "server_s": t_http}));
    }
    if let Some(path) = &a.json {
        let out = serde_json::json!({"model": model, "device": if a.cuda { "cuda:0" } else { "cpu" }, "clients": a.clients, "requests": a.requests,
                                     "max_tokens": a.max_tokens, "command": std::env::args().collect::<Vec<_>>().join(" "), "runs": runs});
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    server.abort();
    Ok(())
}
