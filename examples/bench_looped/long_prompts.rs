//! Suite `cb` with `--long-prompts`: long prompts arriving while short requests decode, served
//! with the prefill chunked at each `--budgets` value (`max_num_batched_tokens`) and unchunked
//! (a budget of the longest prompt: one launch per long prompt, as before chunking).
//!
//! Per budget, on a fresh engine with the same explicit KV pool (what every request needs, so no
//! run waits for KV): W − n short requests (`--prompt-len`, `--new-tokens`) start together; once
//! all decode, the n long prompts arrive one every `--arrival-gap` milliseconds (16 new tokens
//! each). While they prefill — from the first long arrival to the last long
//! request's first token — the short requests' decode tokens/s and their longest gap between two
//! tokens are measured; time to first token is reported for the long requests and for all
//! requests of the run.

use crate::{Args, BenchModel};
use ponder::bench::{fail_on_error, random_ids, served_in_full};
use ponder::{EngineBuilder, Event, GenerationParams, RequestId};
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub(crate) fn long_prompt_suite(args: &Args, model: &BenchModel) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    let spec = model.spec().clone();
    let longest = args.long_prompts.iter().copied().max().unwrap_or(0);
    let mut budgets: Vec<(String, usize)> = args.budgets.iter().map(|&b| (b.to_string(), b)).collect();
    budgets.push(("unchunked".into(), longest.max(args.prompt_len)));
    let mut results = Vec::new();
    let max_len = spec.max_context.min(longest + 64).max(args.prompt_len + args.new_tokens + 16);
    let slots = args.layout.build().num_slots(spec.max_steps);
    for &w in &args.widths {
        let n_long = args.long_prompts.len();
        if n_long >= w {
            return Err(format!("{n_long} long prompts need a width above {n_long}").into());
        }
        // What the default sizing (a fraction of free memory) builds, for the record.
        let sized = EngineBuilder::from_model(model.boxed(), None, vec![])
            .kernels(args.kernels)
            .looped(|o| o.kv_layout(args.layout))
            .max_num_seqs(w)
            .max_model_len(max_len)
            .build()?;
        let auto = sized.metrics().kv_pool;
        drop(sized);
        println!("default KV pool at W {w}: {} blocks, {} positions over {} slots, {:.1} GB", auto.blocks, auto.tokens, auto.slots, auto.bytes as f64 / 1e9);
        println!(
            "{:>6} {:>10} {:>14} {:>14} {:>12} {:>12} {:>12} {:>12}",
            "width", "budget", "short tok/s", "short max gap", "long TTFT", "long TTFT", "TTFT p50", "TTFT p99"
        );
        println!("{:>6} {:>10} {:>14} {:>14} {:>12} {:>12} {:>12} {:>12}", "", "", "(prefilling)", "ms", "mean s", "max s", "all s", "all s");
        let need = (w - n_long) * (args.prompt_len + args.new_tokens + 32) + args.long_prompts.iter().map(|l| l + 48).sum::<usize>();
        for (label, budget) in &budgets {
            let mut engine = EngineBuilder::from_model(model.boxed(), None, vec![])
                .kernels(args.kernels)
                .looped(|o| o.kv_layout(args.layout))
                .max_num_seqs(w)
                .max_num_batched_tokens(*budget)
                .max_model_len(max_len)
                .kv_capacity_tokens((need + 4096) * slots)
                .build()?;
            let pool = engine.metrics().kv_pool;
            // Warm-up: kernels loaded, allocator primed, at this budget.
            let warm = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(4) };
            served_in_full(engine.generate((0..w).map(|i| random_ids(args.prompt_len, spec.vocab_size, 900 + i as u64)), &warm)?, 4)?;
            served_in_full(engine.generate([random_ids(longest.min(4096), spec.vocab_size, 990)], &warm)?, 4)?;

            let short_params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(args.new_tokens) };
            let long_params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(16) };
            let before = engine.metrics().clone();
            let mut added: HashMap<RequestId, Instant> = HashMap::new();
            let mut last: HashMap<RequestId, Instant> = HashMap::new();
            let mut first: HashMap<RequestId, Instant> = HashMap::new();
            let mut shorts = Vec::new();
            for i in 0..w - n_long {
                let id = engine.add_request(random_ids(args.prompt_len, spec.vocab_size, i as u64), short_params.clone())?;
                added.insert(id, Instant::now());
                shorts.push(id);
            }
            let mut longs = Vec::new();
            let mut next_arrival: Option<Instant> = None;
            let (mut window_start, mut window_end) = (None::<Instant>, None::<Instant>);
            let (mut short_tokens, mut gaps) = (0u64, Vec::<Duration>::new());
            while engine.has_work() {
                let decoding = shorts.iter().all(|id| first.contains_key(id));
                if decoding && longs.len() < n_long && next_arrival.is_none_or(|t| Instant::now() >= t) {
                    let len = args.long_prompts[longs.len()];
                    let id = engine.add_request(random_ids(len, spec.vocab_size, 5000 + longs.len() as u64), long_params.clone())?;
                    let now = Instant::now();
                    added.insert(id, now);
                    longs.push(id);
                    window_start.get_or_insert(now);
                    next_arrival = Some(now + Duration::from_millis(args.arrival_gap as u64));
                }
                let events = engine.step()?;
                events.iter().try_for_each(fail_on_error)?;
                let now = Instant::now();
                for ev in &events {
                    if let Event::Token { id, .. } = ev {
                        first.entry(*id).or_insert(now);
                        let prev = last.insert(*id, now);
                        let open = window_start.is_some() && window_end.is_none();
                        if open && shorts.contains(id) {
                            short_tokens += 1;
                            gaps.extend(prev.map(|p| now - p));
                        }
                    }
                }
                if window_end.is_none() && longs.len() == n_long && longs.iter().all(|id| first.contains_key(id)) {
                    window_end = Some(now);
                }
            }
            let m = engine.metrics();
            let window = window_end.zip(window_start).map_or(0.0, |(e, s)| (e - s).as_secs_f64());
            let short_tps = short_tokens as f64 / window.max(1e-9);
            let ttft_long: Vec<f64> = longs.iter().map(|id| (first[id] - added[id]).as_secs_f64()).collect();
            let mean_long = ttft_long.iter().sum::<f64>() / ttft_long.len().max(1) as f64;
            let max_long = ttft_long.iter().copied().fold(0.0, f64::max);
            let mut ttft_all: Vec<f64> = added.iter().map(|(id, a)| first.get(id).map_or(f64::NAN, |f| (*f - *a).as_secs_f64())).collect();
            ttft_all.sort_by(f64::total_cmp);
            gaps.sort();
            let ttft = |q: f64| quantile(&ttft_all, q);
            let gap_ms = |q: f64| quantile(&gaps.iter().map(|g| g.as_secs_f64() * 1e3).collect::<Vec<_>>(), q);
            let max_gap = gaps.last().copied().unwrap_or_default();
            let prefill = |mm: &ponder::EngineMetrics| mm.stages.get("prefill").cloned().unwrap_or_default();
            let prefill_launches = prefill(m).launches - prefill(&before).launches;
            let prefill_s = (prefill(m).time - prefill(&before).time).as_secs_f64();
            let prefill_tokens = prefill(m).tokens - prefill(&before).tokens;
            let decode = |mm: &ponder::EngineMetrics| mm.stages.get("decode").cloned().unwrap_or_default();
            let decode_launches = decode(m).launches - decode(&before).launches;
            let decode_s = (decode(m).time - decode(&before).time).as_secs_f64();
            println!(
                "{w:>6} {label:>10} {short_tps:>14.0} {:>14.1} {mean_long:>12.2} {max_long:>12.2} {:>12.3} {:>12.3}",
                max_gap.as_secs_f64() * 1e3,
                ttft(0.5),
                ttft(0.99)
            );
            results.push(serde_json::json!({
                "mode": "cb-long-prompts", "layout": format!("{:?}", args.layout), "width": w, "budget": label,
                "max_num_batched_tokens": budget, "long_prompts": args.long_prompts, "arrival_gap_ms": args.arrival_gap,
                "short_requests": w - n_long, "short_prompt_len": args.prompt_len, "short_new_tokens": args.new_tokens,
                "window_s": window, "short_tokens_in_window": short_tokens, "short_decode_tokens_per_s": short_tps,
                "short_max_gap_ms": max_gap.as_secs_f64() * 1e3,
                "long_ttft_s": ttft_long, "ttft_p50_s": ttft(0.5), "ttft_p99_s": ttft(0.99),
                "short_gap_p50_ms": gap_ms(0.5), "short_gap_p99_ms": gap_ms(0.99),
                "prefill_launches": prefill_launches, "prefill_s": prefill_s, "prefill_tokens": prefill_tokens,
                "prefill_tokens_per_s": prefill_tokens as f64 / prefill_s.max(1e-9),
                "decode_launches": decode_launches, "decode_s": decode_s,
                "kv_pool": {"blocks": pool.blocks, "tokens": pool.tokens, "bytes": pool.bytes, "slots": pool.slots},
                "default_kv_pool": {"blocks": auto.blocks, "tokens": auto.tokens, "bytes": auto.bytes, "slots": auto.slots},
            }));
        }
    }
    Ok(results)
}

/// The `q` quantile of sorted values (nearest rank; NaN when empty).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}
