//! Host-side overhead of scheduling and KV bookkeeping per engine tick (no model).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ponder::kv::KvManager;
use ponder::looped::gate::{DepthTrace, Replay};
use ponder::looped::layout::{DepthIndexed, KvLayout, LastExited, Shared};
use ponder::looped::{ContinuousBatching, DepthBatching, DepthConfig, LoopedResult, LoopedRowOutput, LoopedScheduler};
use ponder::scheduler::{Requests, SchedRequest, SchedulerLimits};
use ponder::RequestId;

fn decode_tick(c: &mut Criterion) {
    let mut g = c.benchmark_group("cb_decode_tick");
    for width in [16usize, 64, 256] {
        g.bench_with_input(BenchmarkId::from_parameter(width), &width, |b, &w| {
            let limits = SchedulerLimits { max_num_seqs: w, max_num_batched_tokens: 1 << 20 };
            let mut q = Requests::new(KvManager::new(w * 4 * 64, 16, DepthIndexed.num_slots(4)));
            let mut s = ContinuousBatching::new(limits, Box::new(DepthIndexed), 4);
            for i in 0..w {
                q.add(SchedRequest { id: RequestId(i as u64), prompt: vec![1; 128], max_new_tokens: 512 });
            }
            let mut tick = 0u64;
            let mut next_id = w as u64;
            b.iter(|| {
                // Every 256 ticks the cohort finishes and a new one is admitted (amortised).
                tick += 1;
                if tick % 256 == 0 {
                    for i in next_id - w as u64..next_id {
                        q.end(RequestId(i));
                        s.finished(RequestId(i));
                        q.add(SchedRequest { id: RequestId(i + w as u64), prompt: vec![1; 128], max_new_tokens: 512 });
                    }
                    next_id += w as u64;
                }
                let l = s.schedule(&mut q).unwrap();
                s.complete(&mut q, &l, &answer(&l));
            });
        });
    }
}

fn answer(l: &ponder::looped::LoopedLaunch) -> LoopedResult {
    LoopedResult {
        non_finite: vec![],
        rows: l.rows.iter().map(|r| LoopedRowOutput { token: r.sample.then_some(1), gate_logits: vec![1.0], ..LoopedRowOutput::new(r.request) }).collect(),
    }
}

/// One depth-batching launch (any stage) plus its bookkeeping, refill mode, replayed depths
/// (mean 2.5 of 4), last-exited layout (the costliest: exit copies), at widths 64…512.
fn depth_tick(c: &mut Criterion) {
    let mut g = c.benchmark_group("cdb_refill_tick");
    for width in [64usize, 128, 256, 512] {
        g.bench_with_input(BenchmarkId::from_parameter(width), &width, |b, &w| {
            let limits = SchedulerLimits { max_num_seqs: w, max_num_batched_tokens: 1 << 20 };
            let mut q = Requests::new(KvManager::new(w * 4 * 48, 16, LastExited.num_slots(4)));
            let gate = Box::new(Replay::new(DepthTrace::with_mean(2.5, 2, 4, 1).unwrap(), 2, 4).unwrap());
            let mut s = DepthBatching::new(DepthConfig::default(), limits, Box::new(LastExited), gate);
            let mut next = 0u64;
            let mut produced = std::collections::HashMap::new();
            let admit = |q: &mut Requests, n: usize, next: &mut u64| {
                for _ in 0..n {
                    q.add(SchedRequest { id: RequestId(*next), prompt: vec![1; 128], max_new_tokens: 512 });
                    *next += 1;
                }
            };
            admit(&mut q, w, &mut next);
            b.iter(|| {
                let l = s.schedule(&mut q).expect("work");
                let r = answer(&l);
                s.complete(&mut q, &l, &r);
                for row in r.rows.iter().filter(|r| r.token.is_some()) {
                    let p = produced.entry(row.request).or_insert(0usize);
                    *p += 1;
                    if *p == 512 {
                        q.end(row.request);
                        s.finished(row.request);
                        admit(&mut q, 1, &mut next);
                    }
                }
            });
        });
    }
}

fn kv_reserve_free(c: &mut Criterion) {
    c.bench_function("kv_reserve_free_256x384", |b| {
        let mut kv = KvManager::new(256 * 24, 16, Shared.num_slots(4));
        b.iter(|| {
            for i in 0..256 {
                assert!(kv.reserve(RequestId(i), 384));
            }
            for i in 0..256 {
                kv.free(RequestId(i));
            }
        });
    });
}

criterion_group!(benches, decode_tick, depth_tick, kv_reserve_free);
criterion_main!(benches);
