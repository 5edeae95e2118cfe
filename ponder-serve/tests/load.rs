//! The load generator's accounting on a short run (two rates, a few seconds) on the tiny Ouro,
//! through the in-process handle and over HTTP on loopback: every request sent is recorded once
//! and served in full, percentiles are ordered, and the summary's figures equal their
//! definitions recomputed from the recorded times. Nothing about speed.

use ponder::EngineBuilder;
use ponder_serve::load::{self, Arrival, Record, Slo, Summary};
use ponder_serve::{router, AppState, Defaults, Limits};
use std::sync::Arc;
use std::time::Duration;

fn asset(name: &str) -> String {
    format!("{}/../assets/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Short prompts and outputs from a seed (token ids within the tiny Ouro's vocabulary).
fn jobs() -> Vec<(Vec<u32>, usize)> {
    (0..16u32).map(|i| ((0..4 + i % 5).map(|k| 10 + (i * 31 + k * 7) % 400).collect(), 3 + (i as usize % 4))).collect()
}

const WARMUP: Duration = Duration::from_millis(200);
const WINDOW: Duration = Duration::from_millis(1200);
const SLO: Slo = Slo { ttft_ms: 2000.0, tpot_ms: 500.0 };

fn check(label: &str, arrivals: &[Arrival], records: &[Record]) -> Summary {
    assert_eq!(records.len(), arrivals.len(), "{label}: one record per request sent");
    for (a, r) in arrivals.iter().zip(records) {
        assert_eq!(r.sent, a.at, "{label}");
        assert!(r.completed(), "{label}: {r:?}");
        assert_eq!(r.tokens.len(), a.max_tokens, "{label}: every token counted once");
        assert!(r.tokens[0] >= r.sent && r.tokens.windows(2).all(|w| w[0] <= w[1]), "{label}: {r:?}");
    }
    let s = load::summarize(records, (WARMUP, WARMUP + WINDOW), SLO);
    let measured: Vec<&Record> = records.iter().filter(|r| r.sent >= WARMUP && r.sent < WARMUP + WINDOW).collect();
    assert_eq!((s.requests, s.completed, s.failed), (measured.len(), measured.len(), 0), "{label}");
    assert!(s.requests > 0, "{label}: the window holds requests");
    for p in [s.ttft_ms, s.tpot_ms, s.itl_ms, s.e2e_ms, s.normalized_ms] {
        assert!(p.p50 <= p.p90 && p.p90 <= p.p99 && p.p99 <= p.max, "{label}: {p:?}");
    }
    // Normalized latency: end-to-end ÷ output tokens, averaged over requests.
    let norm: f64 = measured.iter().map(|r| (r.tokens.last().unwrap().as_secs_f64() - r.sent.as_secs_f64()) * 1e3 / r.tokens.len() as f64).sum::<f64>()
        / measured.len() as f64;
    assert!((s.normalized_ms.mean - norm).abs() < 1e-6, "{label}: {} vs {norm}", s.normalized_ms.mean);
    let tokens: usize = measured.iter().map(|r| r.tokens.len()).sum();
    assert!((s.output_throughput * s.duration_s - tokens as f64).abs() < 1e-6, "{label}");
    assert!(s.goodput <= s.request_throughput + 1e-9, "{label}");
    s
}

#[test]
fn in_process_accounting_is_consistent_at_two_rates() {
    let engine = EngineBuilder::new(asset("tiny-ouro")).max_num_seqs(8).spawn().unwrap();
    for rate in [10.0, 40.0] {
        let arrivals = load::trace(&jobs(), Some(rate), WARMUP, WINDOW, 0);
        let records = load::in_process(&engine, &arrivals, Duration::from_secs(60));
        let s = check(&format!("in-process at {rate}/s"), &arrivals, &records);
        assert!(s.request_throughput > 0.0);
    }
    let m = engine.metrics().unwrap();
    assert_eq!((m.running_requests, m.waiting_requests, m.kv_blocks_used), (0, 0, 0));
}

/// A diffusion model reveals several tokens at a step: each is still counted once, at the time
/// its event arrived.
#[test]
fn in_process_accounting_is_consistent_for_a_diffusion_model() {
    let engine = EngineBuilder::new(asset("tiny-sdar")).max_num_seqs(8).spawn().unwrap();
    assert!(engine.model().diffusion().is_some() && engine.model().looped().is_none());
    let mask = engine.model().diffusion().unwrap().mask_token_id;
    let jobs: Vec<(Vec<u32>, usize)> = jobs().into_iter().map(|(p, n)| (p.into_iter().filter(|&t| t != mask).collect(), n + 8)).collect();
    for rate in [10.0, 40.0] {
        let arrivals = load::trace(&jobs, Some(rate), WARMUP, WINDOW, 2);
        let records = load::in_process(&engine, &arrivals, Duration::from_secs(60));
        check(&format!("diffusion in-process at {rate}/s"), &arrivals, &records);
    }
    let m = engine.metrics().unwrap();
    assert_eq!((m.running_requests, m.waiting_requests, m.kv_blocks_used), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_accounting_is_consistent_at_two_rates() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let engine = EngineBuilder::new(asset("tiny-ouro")).max_num_seqs(8).spawn().unwrap();
        let state = Arc::new(AppState::new(
            engine,
            Defaults { model: "tiny-ouro".into(), max_tokens: 16, temperature: 0.0 },
            Limits { max_in_flight: usize::MAX, request_timeout: None },
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router(state, 1 << 20)).await.unwrap() });
        let client = reqwest::Client::new();
        for rate in [10.0, 40.0] {
            let arrivals = load::trace(&jobs(), Some(rate), WARMUP, WINDOW, 1);
            let records = load::http(&client, &base, "tiny-ouro", &arrivals, Duration::from_secs(60)).await;
            check(&format!("HTTP at {rate}/s"), &arrivals, &records);
        }
        // A request the server refuses is recorded as failed, not lost.
        let bad = [Arrival { at: Duration::ZERO, prompt: vec![1_000_000], max_tokens: 2 }];
        let records = load::http(&client, &base, "tiny-ouro", &bad, Duration::from_secs(10)).await;
        assert!(records.len() == 1 && records[0].error.as_deref().is_some_and(|e| e.contains("400")), "{records:?}");
    })
    .await
    .expect("the test ran past its time bound");
}
