//! Property test of the schedulers with a fake model: ≥ 1000 random schedules of arrivals,
//! aborts, prompt and output lengths, widths, layouts and exit depths, with launches completed
//! at once or one launch late (overlap). Every request receives exactly its tokens, in order
//! (aborted ones a prefix), and the KV pool ends empty.

use ponder::kv::KvManager;
use ponder::looped::gate::{DepthTrace, ExitGate, Replay};
use ponder::looped::layout::KvLayoutKind;
use ponder::looped::{ContinuousBatching, DepthBatching, DepthConfig, LoopedResult, LoopedRowOutput, LoopedScheduler};
use ponder::scheduler::{Requests, SchedRequest, SchedulerLimits};
use ponder::RequestId;
use proptest::prelude::*;
use std::collections::HashMap;

/// The fake model's output at a position: unique per (request, position).
fn token_at(request: u64, position: usize) -> u32 {
    (request as u32).wrapping_mul(7919).wrapping_add(position as u32 * 31) % 50_000
}

#[derive(Debug, Clone)]
struct Req {
    arrival: usize,
    prompt: usize,
    new_tokens: usize,
    abort_at: Option<usize>,
}

/// A scheduler and the requests the engine core would lend it (a KV pool of 256 blocks).
fn scheduler(
    kind: u8,
    width: usize,
    layout: KvLayoutKind,
    min_coda: usize,
    min_free: usize,
    coda_reserve: usize,
    seed: u64,
) -> (Box<dyn LoopedScheduler>, Requests) {
    let limits = SchedulerLimits { max_num_seqs: width, max_num_batched_tokens: 64 };
    let requests = Requests::new(KvManager::new(256, 4, layout.build().num_slots(4)));
    let gate: Box<dyn ExitGate> = Box::new(Replay::new(DepthTrace::with_mean(2.5, 2, 4, seed).unwrap(), 2, 4).unwrap());
    let s: Box<dyn LoopedScheduler> = match kind {
        0 => Box::new(ContinuousBatching::new(limits, layout.build(), 4).with_min_free_slots(Some(min_free))),
        k => Box::new(DepthBatching::new(
            DepthConfig { refill: k == 1, min_coda_batch_size: min_coda, min_free_slots: Some(min_free), coda_reserve },
            limits,
            layout.build(),
            gate,
        )),
    };
    (s, requests)
}

/// `width`: most rows of a decode launch; `resident`: most requests resident at once.
fn run((mut s, mut q): (Box<dyn LoopedScheduler>, Requests), reqs: &[Req], overlap: bool, width: usize, resident: usize) -> Result<(), TestCaseError> {
    let overlap = overlap && s.supports_overlap();
    let mut pending: Option<(ponder::looped::LoopedLaunch, LoopedResult)> = None;
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut tick = 0;
    let mut aborted = vec![false; reqs.len()];
    // Tokens whose producing row (a prefill's last chunk or a coda) has been issued, per request.
    let mut issued: HashMap<u64, usize> = HashMap::new();
    // Depth schedulers: which request owns each state row. A row changes hands only after its
    // owner's last token was issued (or the owner was aborted / finished).
    let depth = s.name() != "cb";
    let mut owner: HashMap<u32, u64> = HashMap::new();
    // Which request owns each KV block, under the same rule.
    let mut block_owner: HashMap<u32, u64> = HashMap::new();
    loop {
        for (i, r) in reqs.iter().enumerate() {
            if r.arrival == tick {
                q.add(SchedRequest { id: RequestId(i as u64), prompt: (0..r.prompt as u32).collect(), max_new_tokens: r.new_tokens });
                live.insert(i as u64, r.new_tokens);
            }
            if r.abort_at == Some(tick) && live.remove(&(i as u64)).is_some() {
                q.end(RequestId(i as u64));
                s.finished(RequestId(i as u64));
                aborted[i] = true;
            }
        }
        let all_arrived = reqs.iter().all(|r| r.arrival <= tick);
        let next = s.schedule(&mut q);
        if let Some(l) = next.as_ref().filter(|l| l.stage != ponder::looped::Stage::Prefill) {
            prop_assert!(l.rows.len() <= width, "{:?} launch of {} rows at width {width}", l.stage, l.rows.len());
        }
        for row in next.iter().flat_map(|l| &l.rows) {
            let r = row.request.0;
            let done = |o: u64| !live.contains_key(&o) || issued.get(&o).copied().unwrap_or(0) >= reqs[o as usize].new_tokens;
            // (CB may preempt a running request and give its blocks away: depth schedulers only.)
            for &b in row.block_tables.iter().flat_map(|t| t.iter()).filter(|_| depth) {
                if let Some(&o) = block_owner.get(&b).filter(|&&o| o != r) {
                    prop_assert!(done(o), "KV block {b} used by request {r} while request {o} still runs on it");
                }
                block_owner.insert(b, r);
            }
            if depth {
                if let Some(&o) = owner.get(&row.state).filter(|&&o| o != r) {
                    prop_assert!(done(o), "state row {} used by request {r} while request {o} still runs on it", row.state);
                }
                owner.insert(row.state, r);
            }
            if row.sample {
                *issued.entry(r).or_default() += 1;
            }
        }
        // A request whose last token is issued but not yet read back (overlap) has given its
        // resident slot back already; it stays running until the token arrives.
        let draining = live.keys().filter(|_| depth).filter(|id| issued.get(id).copied().unwrap_or(0) >= reqs[**id as usize].new_tokens).count();
        prop_assert!(q.num_running().saturating_sub(draining) <= resident, "{} resident ({draining} draining), at most {resident}", q.num_running());
        if next.is_none() && pending.is_none() {
            if all_arrived {
                break;
            }
            tick += 1;
            continue;
        }
        let ready = next.map(|launch| {
            let rows = launch
                .rows
                .iter()
                .map(|r| LoopedRowOutput { token: r.sample.then(|| token_at(r.request.0, r.start_pos + r.tokens.len())), ..LoopedRowOutput::new(r.request) })
                .collect();
            (launch, LoopedResult { rows, ..Default::default() })
        });
        // With overlap, the launch just scheduled is "running" while the previous one completes.
        let done = if overlap { std::mem::replace(&mut pending, ready) } else { ready };
        let Some((launch, result)) = done else {
            tick += 1;
            continue;
        };
        s.complete(&mut q, &launch, &result);
        for out in &result.rows {
            let (Some(t), Some(left)) = (out.token, live.get_mut(&out.request.0)) else {
                continue;
            };
            got.entry(out.request.0).or_default().push(t);
            *left -= 1;
            if *left == 0 {
                live.remove(&out.request.0);
                q.end(out.request);
                s.finished(out.request);
            }
        }
        tick += 1;
        prop_assert!(tick < 20_000, "no progress");
    }
    prop_assert!(pending.is_none());
    prop_assert!(live.is_empty(), "requests never finished: {:?}", live.keys().collect::<Vec<_>>());
    for (i, r) in reqs.iter().enumerate() {
        let want: Vec<u32> = (0..r.new_tokens).map(|k| token_at(i as u64, r.prompt + k)).collect();
        let g = got.get(&(i as u64)).cloned().unwrap_or_default();
        if aborted[i] {
            prop_assert!(want.starts_with(&g), "request {i} (aborted): {g:?} not a prefix of {want:?}");
        } else {
            prop_assert_eq!(g, want, "request {}", i);
        }
    }
    prop_assert_eq!(q.kv().num_used_blocks(), 0);
    prop_assert_eq!(q.num_running(), 0);
    Ok(())
}

fn req() -> impl Strategy<Value = Req> {
    (0usize..30, 1usize..24, 1usize..20, prop::option::weighted(0.25, 0usize..60)).prop_map(|(arrival, prompt, new_tokens, abort_at)| Req {
        arrival,
        prompt,
        new_tokens,
        abort_at,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1200, ..ProptestConfig::default() })]

    #[test]
    fn no_token_lost_duplicated_or_reordered(
        kind in 0u8..3,
        width in 1usize..6,
        layout in prop::sample::select(vec![KvLayoutKind::Shared, KvLayoutKind::LastExited, KvLayoutKind::FirstThenShared]),
        min_coda in 1usize..4,
        min_free in 1usize..5,
        coda_reserve in 0usize..3,
        overlap in any::<bool>(),
        seed in 0u64..1000,
        reqs in prop::collection::vec(req(), 1..10),
    ) {
        let resident = width + if kind == 1 { coda_reserve } else { 0 };
        run(scheduler(kind, width, layout, min_coda, min_free, coda_reserve, seed), &reqs, overlap, width, resident)?;
    }
}
