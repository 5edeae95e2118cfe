//! The public API's lifecycle and concurrency, adversarially: aborts at every step boundary and
//! of unknown, finished and aborted ids; overlap toggled mid-run; `generate` beside requests
//! added before; the handle dropped under readers, streams dropped unread or part-way; KV
//! exhaustion with preemption; a plug-in that panics on the engine thread, a scheduler whose
//! launches serve nobody; randomized sequences of calls against each request run alone; both
//! families. Each output equals its request run alone (an aborted one, a prefix), each stream
//! ends with one `Finished`, the KV pool ends empty; every test is bounded in time.

mod common;
use common::*;
use ponder::looped::gate::{DepthTrace, ExitGate, FixedDepth, Lookahead, QExit, Replay};
use ponder::{Engine, EngineBuilder, EngineHandle, Error, Event, FinishReason, GenerationParams, KvLayoutKind, RequestId, SchedulerKind};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LIMIT: u64 = 30;

/// Builds an engine of a given width.
type MakeBuilder = Box<dyn Fn(usize) -> EngineBuilder>;

/// Runs `f` on a thread of its own; a panic is re-raised, a run past `secs` fails the test.
fn bounded<T: Send + 'static>(label: &str, secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::Builder::new()
        .name(format!("bounded-{label}"))
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r);
        })
        .unwrap();
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(v)) => {
            let _ = h.join();
            v
        }
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("{label}: did not finish within {secs} s (hang or deadlock)"),
    }
}

/// Drives `engine` until idle (at most `max_steps` steps: a live-lock fails), returning every
/// event per request in order.
fn drain_events(engine: &mut Engine, per: &mut HashMap<RequestId, Vec<Event>>, max_steps: usize) {
    let mut n = 0;
    while engine.has_work() {
        n += 1;
        assert!(n <= max_steps, "engine still has work after {max_steps} steps (live-lock?)");
        for ev in engine.step().unwrap() {
            per.entry(ev.id()).or_default().push(ev);
        }
    }
}

fn tokens_of(evs: &[Event]) -> Vec<u32> {
    evs.iter()
        .filter_map(|e| match e {
            Event::Token { token, .. } => Some(*token),
            _ => None,
        })
        .collect()
}

/// Exactly one `Finished`, last; returns its reason.
fn one_finish(evs: &[Event], label: &str) -> FinishReason {
    let fins: Vec<&Event> = evs.iter().filter(|e| matches!(e, Event::Finished { .. })).collect();
    assert_eq!(fins.len(), 1, "{label}: {} Finished events: {evs:?}", fins.len());
    assert!(matches!(evs.last(), Some(Event::Finished { .. })), "{label}: an event after Finished: {evs:?}");
    match fins[0] {
        Event::Finished { reason, .. } => reason.clone(),
        _ => unreachable!(),
    }
}

fn assert_idle(engine: &Engine, label: &str) {
    let kv = engine.requests().kv();
    assert_eq!((kv.num_used_blocks(), kv.num_resident()), (0, 0), "{label}: KV leaked");
    assert_eq!((engine.requests().num_waiting(), engine.requests().num_running()), (0, 0), "{label}: requests left");
    assert_eq!(engine.num_unfinished(), 0, "{label}");
    let m = engine.metrics();
    assert_eq!((m.kv_blocks_used, m.running_requests, m.waiting_requests), (0, 0, 0), "{label}: metrics gauges");
}

fn lookahead() -> Box<dyn ExitGate> {
    Box::new(Lookahead::new(QExit::new(0.5, 1, 4).unwrap()).unwrap())
}
fn replay() -> Box<dyn ExitGate> {
    Box::new(Replay::new(DepthTrace::with_mean(2.5, 1, 4, 17).unwrap(), 1, 4).unwrap())
}
fn fixed() -> Box<dyn ExitGate> {
    Box::new(FixedDepth::new(4).unwrap())
}

/// A looped configuration that may run with overlap.
#[derive(Clone)]
struct Cfg {
    name: &'static str,
    refill: bool,
    layout: KvLayoutKind,
    gate: fn() -> Box<dyn ExitGate>,
    budget: usize,
    min_coda: Option<usize>,
    coda_reserve: usize,
}

fn overlap_cfgs() -> Vec<Cfg> {
    let c = |name, refill, layout, gate: fn() -> Box<dyn ExitGate>, budget, min_coda, coda_reserve| Cfg {
        name,
        refill,
        layout,
        gate,
        budget,
        min_coda,
        coda_reserve,
    };
    vec![
        c("refill×shared×lookahead", true, KvLayoutKind::Shared, lookahead, 512, None, 0),
        c("refill×last-exited×replay×budget8", true, KvLayoutKind::LastExited, replay, 8, None, 0),
        c("no-refill×shared×replay", false, KvLayoutKind::Shared, replay, 512, None, 0),
        c("refill×depth-indexed×fixed×budget5", true, KvLayoutKind::DepthIndexed, fixed, 5, None, 0),
        c("refill×shared×lookahead×coda3×reserve2", true, KvLayoutKind::Shared, lookahead, 512, Some(3), 2),
    ]
}

fn cfg_builder(dir: &Path, c: &Cfg, width: usize) -> EngineBuilder {
    let dir = dir.to_path_buf();
    let (refill, gate, min_coda, reserve) = (c.refill, (c.gate)(), c.min_coda, c.coda_reserve);
    builder(&dir, c.layout, width).max_num_batched_tokens(c.budget).looped(move |o| {
        let o = o.scheduler(SchedulerKind::Depth { refill }).exit_gate_boxed(gate);
        let o = if let Some(n) = min_coda { o.min_coda_batch_size(n) } else { o };
        if reserve > 0 {
            o.coda_reserve(reserve)
        } else {
            o
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Engine (single-threaded) lifecycle
// ---------------------------------------------------------------------------------------------

/// Abort of unknown, finished, already-aborted, never-started and zero-length ids; step() after
/// everything finished; both families.
#[test]
fn abort_edge_ids_and_idle_steps() {
    bounded("abort_edge_ids", LIMIT * 2, || {
        let (_tmp, dir) = tiny_dir(51);
        let tmp = tempfile::tempdir().unwrap();
        let sdar = tmp.path().join("sdar");
        ponder::testing::write_random_sdar(&sdar, &ponder::testing::tiny_sdar_config(VOCAB), 3).unwrap();
        let engines: Vec<(&str, Engine)> = vec![
            ("cb", builder(&dir, KvLayoutKind::DepthIndexed, 2).build().unwrap()),
            ("depth+overlap", cfg_builder(&dir, &overlap_cfgs()[0], 2).looped(|o| o.overlap(true)).build().unwrap()),
            ("sdar", EngineBuilder::new(&sdar).block_size(4).diffusion(|o| o.block_length(4)).max_num_seqs(2).kv_capacity_tokens(1024).build().unwrap()),
        ];
        for (name, mut e) in engines {
            assert!(matches!(e.abort(RequestId(u64::MAX)), Err(Error::UnknownRequest(_))), "{name}");
            // Nothing to do: step is empty and Ok, repeatedly.
            for _ in 0..3 {
                assert!(e.step().unwrap().is_empty(), "{name}: an idle step produced events");
            }
            let zero = e.add_request(vec![1u32, 2], GenerationParams::greedy(0)).unwrap();
            assert!(matches!(e.abort(zero), Err(Error::UnknownRequest(_))), "{name}: zero-length request");
            let waiting = e.add_request(vec![3u32, 4, 5], GenerationParams::greedy(6)).unwrap();
            e.abort(waiting).unwrap();
            assert!(matches!(e.abort(waiting), Err(Error::UnknownRequest(_))), "{name}: aborted twice");
            let one = e.add_request(vec![6u32], GenerationParams::greedy(1)).unwrap();
            let mut per = HashMap::new();
            drain_events(&mut e, &mut per, 200);
            assert_eq!(one_finish(&per[&zero], name), FinishReason::Length);
            assert!(tokens_of(&per[&zero]).is_empty());
            assert_eq!(one_finish(&per[&waiting], name), FinishReason::Aborted);
            assert!(tokens_of(&per[&waiting]).is_empty(), "{name}: an aborted waiting request produced tokens");
            let r = one_finish(&per[&one], name);
            assert!(matches!(r, FinishReason::Length | FinishReason::Eos), "{name}: {r:?}");
            assert!(tokens_of(&per[&one]).len() <= 1);
            assert!(matches!(e.abort(one), Err(Error::UnknownRequest(_))), "{name}: finished");
            for _ in 0..3 {
                assert!(e.step().unwrap().is_empty(), "{name}: a step after the end produced events");
                assert!(!e.has_work());
            }
            assert!(e.set_overlap(false).is_ok(), "{name}: turning overlap off is always fine");
            assert_idle(&e, name);
        }
    });
}

/// For each step count k: three requests (1, 2 and 7 new tokens), k steps, then every one
/// aborted. Each request ends exactly once; an abort that lands is `Aborted` and its tokens a
/// prefix of its sequential output; one refused was already finished; no KV is held.
fn abort_after_k_steps(label: &str, make: &dyn Fn(usize) -> Engine, ps: &[Vec<u32>], ks: usize) {
    let max_new = [1usize, 2, 7];
    let mut solo = make(1);
    let want: Vec<Vec<u32>> =
        ps.iter().zip(max_new).map(|(p, n)| solo.generate([p.clone()], &GenerationParams::greedy(n)).unwrap().remove(0).unwrap().token_ids).collect();
    for k in 0..ks {
        let mut e = make(3);
        let ids: Vec<RequestId> = ps.iter().zip(max_new).map(|(p, n)| e.add_request(p.clone(), GenerationParams::greedy(n)).unwrap()).collect();
        let mut per: HashMap<RequestId, Vec<Event>> = HashMap::new();
        for _ in 0..k {
            for ev in e.step().unwrap() {
                per.entry(ev.id()).or_default().push(ev);
            }
        }
        let mut landed = Vec::new();
        for &id in &ids {
            landed.push(e.abort(id).is_ok());
        }
        drain_events(&mut e, &mut per, 200);
        for (i, &id) in ids.iter().enumerate() {
            let evs = per.get(&id).cloned().unwrap_or_default();
            let l = format!("{label} k={k} request {i}");
            let reason = one_finish(&evs, &l);
            let got = tokens_of(&evs);
            if landed[i] {
                assert_eq!(reason, FinishReason::Aborted, "{l}");
            } else {
                assert!(matches!(reason, FinishReason::Length | FinishReason::Eos), "{l}: abort refused yet {reason:?}");
                assert_eq!(got, want[i], "{l}");
            }
            assert!(want[i].starts_with(&got), "{l}: {got:?} is not a prefix of {:?}", want[i]);
        }
        assert_idle(&e, &format!("{label} k={k}"));
    }
}

#[test]
fn abort_at_every_step_boundary_looped() {
    bounded("abort_every_step_looped", LIMIT * 4, || {
        let (_tmp, dir) = tiny_dir(52);
        let ps = prompts(3, 8);
        let d = dir.clone();
        abort_after_k_steps("cb", &move |w| builder(&d, KvLayoutKind::DepthIndexed, w).build().unwrap(), &ps, 12);
        for c in overlap_cfgs() {
            for overlap in [false, true] {
                let d = dir.clone();
                let c2 = c.clone();
                abort_after_k_steps(
                    &format!("{} overlap={overlap}", c.name),
                    &move |w| {
                        let mut e = cfg_builder(&d, &c2, w).build().unwrap();
                        if w > 1 {
                            e.set_overlap(overlap).unwrap();
                        }
                        e
                    },
                    &ps,
                    30,
                );
            }
        }
    });
}

#[test]
fn abort_at_every_step_boundary_diffusion() {
    bounded("abort_every_step_diffusion", LIMIT * 4, || {
        let tmp = tempfile::tempdir().unwrap();
        let sdar = tmp.path().join("sdar");
        ponder::testing::write_random_sdar(&sdar, &ponder::testing::tiny_sdar_config(VOCAB), 3).unwrap();
        let llada = tmp.path().join("llada");
        ponder::testing::write_random_llada(&llada, &ponder::testing::tiny_llada_config(VOCAB), 4).unwrap();
        let ps = diffusion_prompts(3, 8);
        for dir in [sdar, llada] {
            let d = dir.clone();
            let make = move |w: usize| {
                EngineBuilder::new(&d)
                    .block_size(4)
                    .max_num_seqs(w)
                    .kv_capacity_tokens(1024)
                    .diffusion(|o| o.block_length(4).unmask_policy(ponder::diffusion::StaticCount::new(1).unwrap()))
                    .build()
                    .unwrap()
            };
            abort_after_k_steps(&format!("{dir:?}"), &make, &ps, 14);
        }
    });
}

/// Overlap turned on and off at every step (a pattern), with arrivals and aborts mid-run:
/// the surviving requests' tokens equal sequential output and no KV is held.
#[test]
fn overlap_toggled_mid_run_with_arrivals_and_aborts() {
    bounded("overlap_toggle", LIMIT * 4, || {
        let (_tmp, dir) = tiny_dir(53);
        let ps = prompts(7, 21);
        let max_new: Vec<usize> = (0..ps.len()).map(|i| 3 + (i * 4) % 9).collect();
        for c in overlap_cfgs() {
            let want = sequential(&mut cfg_builder(&dir, &c, 1).build().unwrap(), &ps, &max_new);
            for pattern in [0b1010_1010u32, 0b1100_1110, 0b0111_0001] {
                let mut e = cfg_builder(&dir, &c, 3).build().unwrap();
                let mut ids = Vec::new();
                let mut per: HashMap<RequestId, Vec<Event>> = HashMap::new();
                let mut aborted = Vec::new();
                let mut step = 0usize;
                while ids.len() < ps.len() || e.has_work() {
                    assert!(step < 500, "{}: live-lock", c.name);
                    e.set_overlap(pattern >> (step % 8) & 1 == 1).unwrap();
                    if step % 2 == 0 && ids.len() < ps.len() {
                        let i = ids.len();
                        ids.push(e.add_request(ps[i].clone(), GenerationParams::greedy(max_new[i])).unwrap());
                    }
                    if step == 7 && e.abort(ids[2]).is_ok() {
                        aborted.push(ids[2]);
                    }
                    for ev in e.step().unwrap() {
                        per.entry(ev.id()).or_default().push(ev);
                    }
                    step += 1;
                }
                e.set_overlap(false).unwrap();
                for (i, id) in ids.iter().enumerate() {
                    let evs = per.get(id).cloned().unwrap_or_default();
                    let l = format!("{} pattern {pattern:#b} request {i}", c.name);
                    one_finish(&evs, &l);
                    let got = tokens_of(&evs);
                    if aborted.contains(id) {
                        assert!(want[i].starts_with(&got), "{l}");
                    } else {
                        assert_eq!(got, want[i], "{l}");
                    }
                }
                assert_idle(&e, c.name);
            }
        }
    });
}

/// max_new_tokens 0 and 1 mixed with longer requests, batched and with overlap: equal to each
/// alone; forced tokens longer than max_new_tokens give exactly max_new_tokens forced tokens,
/// and the tokens after a shorter forced prefix are the same with and without overlap.
#[test]
fn tiny_lengths_and_forced_tokens_batched_and_overlapped() {
    bounded("tiny_lengths", LIMIT * 3, || {
        let (_tmp, dir) = tiny_dir(54);
        let ps = prompts(6, 31);
        let max_new = [0usize, 1, 5, 0, 1, 9];
        for c in overlap_cfgs() {
            let want = sequential(&mut cfg_builder(&dir, &c, 1).build().unwrap(), &ps, &max_new);
            for overlap in [false, true] {
                let mut e = cfg_builder(&dir, &c, 3).build().unwrap();
                e.set_overlap(overlap).unwrap();
                assert_eq!(batched(&mut e, &ps, &max_new), want, "{} overlap={overlap}", c.name);
                assert_idle(&e, c.name);
            }
            // Teacher forcing: longer than max_new_tokens, and a short prefix then free decoding.
            let forced: Vec<u32> = vec![5, 9, 13, 17, 21, 25, 29, 33];
            let mut outs = Vec::new();
            for overlap in [false, true] {
                let mut e = cfg_builder(&dir, &c, 3).build().unwrap();
                e.set_overlap(overlap).unwrap();
                let long = GenerationParams { forced_tokens: forced.clone(), ignore_eos: true, ..GenerationParams::greedy(3) };
                let short = GenerationParams { forced_tokens: forced[..2].to_vec(), ignore_eos: true, ..GenerationParams::greedy(6) };
                let a = e.add_request(ps[2].clone(), long).unwrap();
                let b = e.add_request(ps[5].clone(), short).unwrap();
                let mut per = HashMap::new();
                drain_events(&mut e, &mut per, 300);
                assert_eq!(tokens_of(&per[&a]), forced[..3].to_vec(), "{} overlap={overlap}", c.name);
                let tb = tokens_of(&per[&b]);
                assert_eq!(tb.len(), 6, "{} overlap={overlap}", c.name);
                assert_eq!(&tb[..2], &forced[..2], "{} overlap={overlap}", c.name);
                outs.push(tb);
                assert_idle(&e, c.name);
            }
            assert_eq!(outs[0], outs[1], "{}: decoding after a forced prefix differs under overlap", c.name);
        }
    });
}

/// A stop string that the prompt ends with (and one the prompt contains) does not stop the
/// request before it generates: stop strings apply to the output only.
#[test]
fn stop_strings_matching_the_prompt_end() {
    bounded("stop_prompt_end", LIMIT * 2, || {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro"));
        let mut e = EngineBuilder::new(&dir).max_num_seqs(2).build().unwrap();
        let prompt = "The borrow checker";
        let plain = e.generate([prompt], &GenerationParams { ignore_eos: true, ..GenerationParams::greedy(12) }).unwrap().remove(0).unwrap();
        assert!(!plain.text.is_empty());
        for stop in ["checker", "r", " checker", "The borrow checker"] {
            let params = GenerationParams { stop: vec![stop.to_string()], ignore_eos: true, ..GenerationParams::greedy(12) };
            let out = e.generate([prompt], &params).unwrap().remove(0).unwrap();
            match plain.text.find(stop) {
                Some(pos) => {
                    assert_eq!(out.finish_reason, FinishReason::Stop(stop.to_string()), "stop {stop:?}");
                    assert_eq!(out.text, plain.text[..pos], "stop {stop:?}");
                }
                None => {
                    assert_eq!(out.finish_reason, FinishReason::Length, "stop {stop:?}: the prompt's end stopped it");
                    assert_eq!(out.text, plain.text, "stop {stop:?}");
                }
            }
        }
        assert_idle(&e, "stop");
    });
}

/// `generate` while another request added by `add_request` is in flight: that request's events
/// are consumed by `generate` and never reach the caller.
#[test]
fn generate_beside_an_added_request_keeps_its_events() {
    bounded("generate_beside_added", LIMIT, || {
        let (_tmp, dir) = tiny_dir(55);
        let ps = prompts(2, 3);
        let mut solo = builder(&dir, KvLayoutKind::DepthIndexed, 1).build().unwrap();
        let want = sequential(&mut solo, &ps, &[8, 4]);
        let mut e = builder(&dir, KvLayoutKind::DepthIndexed, 2).build().unwrap();
        let a = e.add_request(ps[0].clone(), GenerationParams::greedy(8)).unwrap();
        let outs = e.generate([ps[1].clone()], &GenerationParams::greedy(4)).unwrap();
        assert_eq!(outs[0].as_ref().unwrap().token_ids, want[1]);
        let mut per = HashMap::new();
        drain_events(&mut e, &mut per, 100);
        let got = per.get(&a).map(|v| tokens_of(v)).unwrap_or_default();
        let finished = per.get(&a).is_some_and(|v| v.iter().any(|e| matches!(e, Event::Finished { .. })));
        assert!(finished && got == want[0], "request added before generate: got {got:?} (finished event seen: {finished}), want {:?}", want[0]);
        assert_idle(&e, "generate");
    });
}

/// Seeded sampling, log-probabilities and teacher forcing under CB preemption (a tiny pool):
/// equal to each request alone; KV empty.
#[test]
fn preemption_keeps_sampled_forced_and_logprob_outputs() {
    bounded("preemption_sampled", LIMIT * 3, || {
        let (_tmp, dir) = tiny_dir(56);
        let ps = prompts(6, 41);
        let params = |i: usize| GenerationParams {
            max_new_tokens: 16,
            sampling: if i % 2 == 0 {
                ponder::SamplingParams { temperature: 0.9, top_k: Some(30), top_p: Some(0.95), seed: Some(i as u64) }
            } else {
                Default::default()
            },
            forced_tokens: if i % 3 == 0 { vec![7, 8, 9] } else { vec![] },
            logprobs: (i % 2 == 1).then_some(2),
            ignore_eos: true,
            ..Default::default()
        };
        for layout in [KvLayoutKind::DepthIndexed, KvLayoutKind::Shared] {
            let slots = if layout == KvLayoutKind::Shared { 1 } else { 4 };
            let mut solo = builder(&dir, layout, 1).build().unwrap();
            let want: Vec<ponder::Output> = ps.iter().enumerate().map(|(i, p)| solo.generate([p.clone()], &params(i)).unwrap().remove(0).unwrap()).collect();
            let mut e = builder(&dir, layout, 6).kv_capacity_tokens(72 * slots).build().unwrap();
            let ids: Vec<RequestId> = ps.iter().enumerate().map(|(i, p)| e.add_request(p.clone(), params(i)).unwrap()).collect();
            let mut outs: HashMap<RequestId, ponder::Output> = ids.iter().map(|&id| (id, ponder::Output::new(id, 0))).collect();
            let mut n = 0;
            while e.has_work() {
                n += 1;
                assert!(n < 2000, "live-lock");
                for ev in e.step().unwrap() {
                    outs.get_mut(&ev.id()).unwrap().push(ev);
                }
            }
            assert!(e.metrics().preemptions > 0, "{layout:?}: the pool was meant to run out");
            for (i, id) in ids.iter().enumerate() {
                let (g, w) = (&outs[id], &want[i]);
                assert_eq!(g.token_ids, w.token_ids, "{layout:?} request {i}");
                assert_eq!(g.logprobs.len(), w.logprobs.len(), "{layout:?} request {i}");
                assert!(g.logprobs.iter().zip(&w.logprobs).all(|(a, b)| (a - b).abs() < 1e-4), "{layout:?} request {i}: {:?} vs {:?}", g.logprobs, w.logprobs);
            }
            assert_idle(&e, "preemption");
        }
    });
}

// ---------------------------------------------------------------------------------------------
// EngineHandle
// ---------------------------------------------------------------------------------------------

/// Waits (bounded) until the handle's metrics show no running or waiting request and no KV.
fn wait_handle_idle(h: &EngineHandle, label: &str) -> ponder::EngineMetrics {
    let start = Instant::now();
    loop {
        let m = h.metrics().unwrap();
        if m.running_requests == 0 && m.waiting_requests == 0 && m.kv_blocks_used == 0 {
            return m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{label}: engine not idle: running {} waiting {} kv {}",
            m.running_requests,
            m.waiting_requests,
            m.kv_blocks_used
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reads a stream with a deadline (a stream that never ends fails the test).
fn read_all(stream: ponder::RequestStream, label: String) -> ponder::Output {
    bounded(&label.clone(), LIMIT, move || stream.collect_output())
}

/// Many submitters, a thread dropping streams part-way, a thread aborting (its own, unknown and
/// repeated ids), a metrics poller; a KV pool small enough to preempt (CB) or queue (depth).
/// Kept requests equal sequential output; the engine ends idle with no KV.
fn handle_stress(label: &'static str, make: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync>, prompts_: Vec<Vec<u32>>, max_new: usize) {
    let want = sequential(&mut make(1).build().unwrap(), &prompts_, &vec![max_new; prompts_.len()]);
    let handle = Arc::new(make(6).spawn().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let polls = Arc::new(AtomicUsize::new(0));
    let poller = {
        let (h, stop, polls) = (handle.clone(), stop.clone(), polls.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let m = h.metrics().unwrap();
                assert!(m.kv_blocks_used <= m.kv_pool.blocks);
                polls.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let mut joins = Vec::new();
    for t in 0..4 {
        let (h, ps, want) = (handle.clone(), prompts_.clone(), want.clone());
        joins.push(std::thread::spawn(move || {
            let mine: Vec<usize> = (0..ps.len()).filter(|i| i % 4 == t).collect();
            let streams: Vec<_> = mine.iter().map(|&i| (i, h.submit(ps[i].clone(), GenerationParams::greedy(max_new)).unwrap())).collect();
            for (i, s) in streams {
                let out = s.collect_output();
                assert!(matches!(out.finish_reason, FinishReason::Length | FinishReason::Eos), "{label} request {i}: {:?}", out.finish_reason);
                assert_eq!(out.token_ids, want[i], "{label} request {i}");
            }
        }));
    }
    {
        let (h, ps) = (handle.clone(), prompts_.clone());
        joins.push(std::thread::spawn(move || {
            for j in 0..8 {
                let mut s = h.submit(ps[j % ps.len()].clone(), GenerationParams::greedy(max_new)).unwrap();
                for _ in 0..(j % 3) {
                    s.next();
                }
                drop(s);
            }
        }));
    }
    {
        let (h, ps) = (handle.clone(), prompts_.clone());
        joins.push(std::thread::spawn(move || {
            let _ = h.abort(RequestId(987_654));
            for j in 0..4 {
                let mut s = h.submit(ps[(j + 1) % ps.len()].clone(), GenerationParams::greedy(max_new)).unwrap();
                if j % 2 == 0 {
                    s.next();
                }
                h.abort(s.id).unwrap();
                h.abort(s.id).unwrap();
                let evs: Vec<Event> = s.collect();
                let r = one_finish(&evs, label);
                assert!(matches!(r, FinishReason::Aborted | FinishReason::Length | FinishReason::Eos), "{label}: {r:?}");
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(LIMIT * 2);
    for j in joins {
        while !j.is_finished() {
            assert!(Instant::now() < deadline, "{label}: a client thread hung");
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Err(p) = j.join() {
            stop.store(true, Ordering::SeqCst);
            std::panic::resume_unwind(p);
        }
    }
    let m = wait_handle_idle(&handle, label);
    stop.store(true, Ordering::SeqCst);
    poller.join().unwrap();
    assert!(polls.load(Ordering::SeqCst) > 0);
    eprintln!("{label}: preemptions {} finished {}", m.preemptions, m.finished_requests);
    let h = Arc::try_unwrap(handle).ok().expect("only this thread holds the handle");
    bounded(label, LIMIT, move || drop(h));
}

#[test]
fn handle_stress_cb_with_preemption() {
    bounded("stress_cb", LIMIT * 4, || {
        let (tmp, dir) = tiny_dir(61);
        let make: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync> = Arc::new(move |w| {
            let b = builder(&dir, KvLayoutKind::DepthIndexed, w);
            if w > 1 {
                b.kv_capacity_tokens(4 * 72)
            } else {
                b
            }
        });
        handle_stress("cb", make, prompts(12, 5), 12);
        drop(tmp);
    });
}

#[test]
fn handle_stress_depth_overlap_small_pool() {
    bounded("stress_depth", LIMIT * 4, || {
        let (tmp, dir) = tiny_dir(62);
        let c = overlap_cfgs()[0].clone();
        let make: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync> = Arc::new(move |w| {
            let b = cfg_builder(&dir, &c, w);
            if w > 1 {
                b.kv_capacity_tokens(96).looped(|o| o.overlap(true))
            } else {
                b
            }
        });
        handle_stress("depth+overlap", make, prompts(12, 6), 12);
        drop(tmp);
    });
}

#[test]
fn handle_stress_diffusion() {
    bounded("stress_diffusion", LIMIT * 4, || {
        let tmp = Arc::new(tempfile::tempdir().unwrap());
        let sdar = tmp.path().join("sdar");
        ponder::testing::write_random_sdar(&sdar, &ponder::testing::tiny_sdar_config(VOCAB), 3).unwrap();
        let llada = tmp.path().join("llada");
        ponder::testing::write_random_llada(&llada, &ponder::testing::tiny_llada_config(VOCAB), 4).unwrap();
        for (label, dir) in [("sdar", sdar), ("llada", llada)] {
            let make: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync> = Arc::new(move |w| {
                EngineBuilder::new(&dir)
                    .block_size(4)
                    .max_num_seqs(w)
                    .kv_capacity_tokens(if w > 1 { 96 } else { 1024 })
                    .diffusion(|o| o.block_length(4).unmask_policy(ponder::diffusion::StaticCount::new(2).unwrap()))
            });
            handle_stress(label, make, diffusion_prompts(12, 7), 10);
        }
    });
}

/// The handle dropped while other threads read their streams: every reader ends (with
/// `Finished`), and the drop returns.
#[test]
fn dropping_the_handle_ends_readers_on_other_threads() {
    bounded("drop_handle_readers", LIMIT * 2, || {
        let (_tmp, dir) = tiny_dir(63);
        let tmp = tempfile::tempdir().unwrap();
        let sdar = tmp.path().join("sdar");
        ponder::testing::write_random_sdar(&sdar, &ponder::testing::tiny_sdar_config(VOCAB), 3).unwrap();
        let handles: Vec<(&str, EngineHandle)> = vec![
            ("cb", builder(&dir, KvLayoutKind::DepthIndexed, 2).spawn().unwrap()),
            ("depth+overlap", cfg_builder(&dir, &overlap_cfgs()[0], 2).looped(|o| o.overlap(true)).spawn().unwrap()),
            ("sdar", EngineBuilder::new(&sdar).block_size(4).max_num_seqs(2).diffusion(|o| o.block_length(4)).spawn().unwrap()),
        ];
        for (name, handle) in handles {
            let ps = if name == "sdar" { diffusion_prompts(5, 2) } else { prompts(5, 2) };
            let streams: Vec<_> =
                ps.iter().map(|p| handle.submit(p.clone(), GenerationParams { ignore_eos: true, ..GenerationParams::greedy(400) }).unwrap()).collect();
            let (started_tx, started_rx) = std::sync::mpsc::channel();
            let readers: Vec<_> = streams
                .into_iter()
                .map(|mut s| {
                    let tx = started_tx.clone();
                    std::thread::spawn(move || {
                        let first = s.next();
                        let _ = tx.send(());
                        let mut evs: Vec<Event> = first.into_iter().collect();
                        evs.extend(s);
                        evs
                    })
                })
                .collect();
            // Wait until at least one reader got its first event, then drop the handle.
            started_rx.recv_timeout(Duration::from_secs(LIMIT)).expect("a first event");
            let dropped = Instant::now();
            drop(handle);
            let deadline = Instant::now() + Duration::from_secs(LIMIT);
            for r in readers {
                while !r.is_finished() {
                    assert!(Instant::now() < deadline, "{name}: a reader still blocks after the handle was dropped");
                    std::thread::sleep(Duration::from_millis(10));
                }
                let evs = r.join().unwrap();
                let reason = one_finish(&evs, name);
                assert!(matches!(reason, FinishReason::Aborted | FinishReason::Length), "{name}: {reason:?}");
            }
            eprintln!("{name}: readers ended {:?} after the drop", dropped.elapsed());
        }
    });
}

/// Streams read only after the handle is gone end with `Finished`; a stream dropped before
/// anything was read (running or still waiting for a slot) frees its request.
#[test]
fn streams_outlive_the_handle_and_unread_streams_are_freed() {
    bounded("streams_outlive", LIMIT * 2, || {
        let (_tmp, dir) = tiny_dir(64);
        let handle = builder(&dir, KvLayoutKind::DepthIndexed, 1).spawn().unwrap();
        let ps = prompts(4, 9);
        let streams: Vec<_> = ps.iter().map(|p| handle.submit(p.clone(), GenerationParams::greedy(300)).unwrap()).collect();
        let zero = handle.submit(ps[0].clone(), GenerationParams::greedy(0)).unwrap();
        drop(handle);
        for s in streams {
            let out = read_all(s, "after drop".into());
            assert!(matches!(out.finish_reason, FinishReason::Aborted | FinishReason::Length | FinishReason::Eos), "{:?}", out.finish_reason);
        }
        let out = read_all(zero, "zero after drop".into());
        assert_eq!(out.finish_reason, FinishReason::Length);

        // Unread streams dropped at once: the running one and those queued behind it (width 1).
        let handle = builder(&dir, KvLayoutKind::DepthIndexed, 1).spawn().unwrap();
        for p in &ps {
            drop(handle.submit(p.clone(), GenerationParams::greedy(300)).unwrap());
        }
        let m = wait_handle_idle(&handle, "unread streams");
        assert!(m.generated_tokens < 50, "the dropped requests kept computing: {} tokens", m.generated_tokens);
        // The engine still serves.
        let out = read_all(handle.submit(ps[1].clone(), GenerationParams::greedy(3)).unwrap(), "after drops".into());
        assert_eq!(out.token_ids.len(), 3);
        bounded("drop", LIMIT, move || drop(handle));
    });
}

/// A handle on an engine built with overlap, whose streams are all dropped after one token each
/// while new ones arrive: the engine ends idle.
#[test]
fn dropping_streams_under_overlap_frees_everything() {
    bounded("drop_streams_overlap", LIMIT * 2, || {
        let (_tmp, dir) = tiny_dir(65);
        for c in overlap_cfgs() {
            let handle = cfg_builder(&dir, &c, 3).looped(|o| o.overlap(true)).spawn().unwrap();
            for (j, p) in prompts(10, 4).into_iter().enumerate() {
                let mut s = handle.submit(p, GenerationParams::greedy(2 + j % 4)).unwrap();
                if j % 2 == 0 {
                    s.next();
                }
            }
            wait_handle_idle(&handle, c.name);
            bounded("drop", LIMIT, move || drop(handle));
        }
    });
}

/// set_overlap on a diffusion engine: a typed error to turn on, fine to turn off.
#[test]
fn set_overlap_on_diffusion_is_typed() {
    bounded("overlap_diffusion", LIMIT, || {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-llada"));
        let mut e = EngineBuilder::new(&dir).max_num_seqs(2).build().unwrap();
        assert!(matches!(e.set_overlap(true), Err(Error::InvalidOption(_))));
        e.add_request("hello", GenerationParams::greedy(3)).unwrap();
        e.step().unwrap();
        assert!(e.set_overlap(false).is_ok());
        assert!(matches!(e.set_overlap(true), Err(Error::InvalidOption(_))));
        let mut per = HashMap::new();
        drain_events(&mut e, &mut per, 200);
        assert_idle(&e, "llada");
    });
}

// ---------------------------------------------------------------------------------------------
// Randomised API sequences
// ---------------------------------------------------------------------------------------------

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// A request's parameters drawn at random (`looped`: teacher forcing and log-probabilities too).
fn random_params(r: &mut Lcg, looped: bool) -> GenerationParams {
    let max_new = [0usize, 1, 1, 2, 3, 5, 8, 13, 21, 30][r.below(10) as usize];
    let mut p = GenerationParams::greedy(max_new);
    p.ignore_eos = r.chance(30);
    if r.chance(30) {
        p.sampling = ponder::SamplingParams { temperature: 0.8, top_k: Some(1 + r.below(40) as usize), top_p: Some(0.9), seed: Some(r.next()) };
    }
    if looped && r.chance(25) {
        p.forced_tokens = (0..r.below(10)).map(|_| r.below(VOCAB as u64) as u32).collect();
    }
    if looped && r.chance(25) {
        p.logprobs = Some(r.below(4) as usize);
    }
    p
}

fn random_prompt(r: &mut Lcg, looped: bool) -> Vec<u32> {
    // The tiny diffusion models' mask id is the last of the vocabulary.
    let v = if looped { VOCAB as u64 } else { VOCAB as u64 - 1 };
    let cap = if r.chance(20) { 40 } else { 12 };
    (0..1 + r.below(cap)).map(|_| r.below(v) as u32).collect()
}

/// One random run: requests added, aborted (known, finished, unknown ids), overlap toggled,
/// steps; then drained. Every request ends once; those not aborted equal their solo output
/// (same id, so id-keyed gates and draws agree); aborted ones are prefixes; KV ends empty.
fn fuzz_run(label: &str, make: &dyn Fn(usize) -> EngineBuilder, looped: bool, overlap_ok: bool, seed: u64, ops: usize) {
    let mut r = Lcg(seed);
    let mut e = make(3).build().unwrap();
    let mut added: Vec<(RequestId, Vec<u32>, GenerationParams)> = Vec::new();
    let mut rejected: Vec<u64> = Vec::new();
    let mut aborted = std::collections::HashSet::new();
    let mut per: HashMap<RequestId, Vec<Event>> = HashMap::new();
    let mut next_id = 0u64;
    for _ in 0..ops {
        while r.chance(40) {
            let (prompt, params) = (random_prompt(&mut r, looped), random_params(&mut r, looped));
            match e.add_request(prompt.clone(), params.clone()) {
                Ok(id) => {
                    assert_eq!(id.0, next_id, "{label}");
                    added.push((id, prompt, params));
                }
                Err(Error::InvalidRequest { id, .. } | Error::KvExhausted { id, .. }) => {
                    assert_eq!(id.0, next_id);
                    rejected.push(id.0)
                }
                Err(other) => panic!("{label}: unexpected {other:?}"),
            }
            next_id += 1;
        }
        if r.chance(12) {
            let id = if added.is_empty() || r.chance(20) { RequestId(10_000 + r.below(5)) } else { added[r.below(added.len() as u64) as usize].0 };
            match e.abort(id) {
                Ok(()) => assert!(aborted.insert(id), "{label}: {id} aborted twice with Ok"),
                Err(Error::UnknownRequest(_)) => {}
                Err(other) => panic!("{label}: abort: {other:?}"),
            }
        }
        if overlap_ok && r.chance(15) {
            e.set_overlap(r.chance(50)).unwrap();
        }
        for ev in e.step().unwrap() {
            per.entry(ev.id()).or_default().push(ev);
        }
    }
    let mut n = 0;
    while e.has_work() {
        n += 1;
        assert!(n < 3000, "{label}: live-lock");
        if overlap_ok && r.chance(15) {
            e.set_overlap(r.chance(50)).unwrap();
        }
        for ev in e.step().unwrap() {
            per.entry(ev.id()).or_default().push(ev);
        }
    }
    assert_idle(&e, label);
    let mut reasons: HashMap<String, usize> = HashMap::new();
    for evs in per.values() {
        if let Some(Event::Finished { reason, .. }) = evs.last() {
            *reasons.entry(format!("{reason:?}").chars().take(8).collect()).or_default() += 1;
        }
    }
    eprintln!("{label} seed {seed}: {} added, {} rejected, preemptions {}, {reasons:?}", added.len(), rejected.len(), e.metrics().preemptions);
    // Solo references, with ids burnt so every request runs under its own id.
    let mut solo = make(1).build().unwrap();
    let mut solo_next = 0u64;
    for (id, prompt, params) in &added {
        while solo_next < id.0 {
            assert!(solo.add_request(Vec::<u32>::new(), GenerationParams::greedy(1)).is_err());
            solo_next += 1;
        }
        let want = solo.generate([prompt.clone()], params).unwrap().remove(0).unwrap();
        solo_next += 1;
        let evs = per.get(id).cloned().unwrap_or_default();
        let l = format!("{label} seed {seed} {id} ({} prompt, {params:?})", prompt.len());
        let reason = one_finish(&evs, &l);
        let mut got = ponder::Output::new(*id, prompt.len());
        for ev in evs {
            got.push(ev);
        }
        if aborted.contains(id) {
            assert!(want.token_ids.starts_with(&got.token_ids), "{l}: aborted output {:?} not a prefix of {:?}", got.token_ids, want.token_ids);
            assert!(matches!(reason, FinishReason::Aborted), "{l}: {reason:?}");
        } else {
            assert_eq!(got.token_ids, want.token_ids, "{l}");
            assert_eq!(reason, want.finish_reason, "{l}");
            assert_eq!(got.logprobs.len(), want.logprobs.len(), "{l}");
            assert!(got.logprobs.iter().zip(&want.logprobs).all(|(a, b)| (a - b).abs() < 1e-4), "{l}: logprobs");
        }
    }
}

fn tiny_dir_with_eos(seed: u64, eos: &[u32]) -> (tempfile::TempDir, PathBuf) {
    let mut cfg = ponder::testing::tiny_ouro_config(VOCAB);
    cfg.eos_token_id = Some(ponder::config::EosIds::Many(eos.to_vec()));
    tiny_dir_with(cfg, seed)
}

#[test]
fn fuzz_looped_api_sequences() {
    bounded("fuzz_looped", LIMIT * 6, || {
        // An eos the tiny model does produce, so requests also end early under overlap.
        let (_tmp, dir) = tiny_dir_with_eos(57, &[55, 23]);
        let mut cfgs: Vec<(String, MakeBuilder, bool)> = Vec::new();
        for c in overlap_cfgs() {
            let d = dir.clone();
            let c2 = c.clone();
            cfgs.push((c.name.to_string(), Box::new(move |w| cfg_builder(&d, &c2, w)), true));
            let d = dir.clone();
            let c2 = c.clone();
            let slots = if c.layout == KvLayoutKind::Shared { 1 } else { 4 };
            cfgs.push((format!("{} small pool", c.name), Box::new(move |w| cfg_builder(&d, &c2, w).kv_capacity_tokens(80 * slots)), true));
        }
        for layout in [KvLayoutKind::DepthIndexed, KvLayoutKind::Shared] {
            let d = dir.clone();
            let slots = if layout == KvLayoutKind::Shared { 1 } else { 4 };
            cfgs.push((
                format!("cb {layout:?} small pool"),
                Box::new(move |w| builder(&d, layout, w).max_num_batched_tokens(8).kv_capacity_tokens(48 * slots)),
                false,
            ));
        }
        for (name, make, overlap) in &cfgs {
            for seed in 0..4 {
                fuzz_run(name, make.as_ref(), true, *overlap, seed * 7919 + 1, 60);
            }
        }
    });
}

#[test]
fn fuzz_diffusion_api_sequences() {
    bounded("fuzz_diffusion", LIMIT * 6, || {
        use ponder::testing::*;
        let tmp = tempfile::tempdir().unwrap();
        let mut sdar_cfg = tiny_sdar_config(VOCAB);
        sdar_cfg.eos_token_id = Some(ponder::config::EosIds::Many(vec![55, 23]));
        let sdar = tmp.path().join("sdar");
        write_random_sdar(&sdar, &sdar_cfg, 3).unwrap();
        let llada = tmp.path().join("llada");
        write_random_llada(&llada, &tiny_llada_config(VOCAB), 4).unwrap();
        let dream = tmp.path().join("dream");
        write_random_dream(&dream, &tiny_dream_config(VOCAB), 5).unwrap();
        for (name, dir) in [("sdar", sdar), ("llada", llada), ("dream", dream)] {
            for delayed in [false, true] {
                if delayed && name != "sdar" {
                    continue;
                }
                let d = dir.clone();
                let make = move |w: usize| {
                    EngineBuilder::new(&d)
                        .block_size(4)
                        .max_num_seqs(w)
                        .max_num_batched_tokens(32)
                        .kv_capacity_tokens(if w > 1 { 96 } else { 1024 })
                        .diffusion(move |o| o.block_length(4).delayed_cache(delayed))
                };
                for seed in 0..5 {
                    fuzz_run(&format!("{name} delayed={delayed}"), &make, false, false, seed * 104729 + 3, 50);
                }
            }
        }
    });
}

#[test]
fn fuzz_huginn_api_sequences() {
    bounded("fuzz_huginn", LIMIT * 4, || {
        let mut cfg = ponder::testing::tiny_huginn_config(VOCAB);
        cfg.eos_token_id = Some(ponder::config::EosIds::Many(vec![55, 23]));
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("huginn");
        ponder::testing::write_random_huginn(&dir, &cfg, 5).unwrap();
        for (name, reserve, coda) in [("huginn refill", 0usize, 1usize), ("huginn reserve2 coda3", 2, 3)] {
            let d = dir.clone();
            let make = move |w: usize| {
                builder(&d, KvLayoutKind::Shared, w).kv_capacity_tokens(if w > 1 { 120 } else { 4096 }).looped(move |o| {
                    let o = o
                        .scheduler(SchedulerKind::Depth { refill: true })
                        .exit_gate(Replay::new(DepthTrace::with_mean(3.5, 2, 6, 13).unwrap(), 2, 6).unwrap())
                        .min_coda_batch_size(coda);
                    if reserve > 0 {
                        o.coda_reserve(reserve)
                    } else {
                        o
                    }
                })
            };
            for seed in 0..4 {
                fuzz_run(name, &make, true, true, seed * 31 + 5, 50);
            }
        }
    });
}

/// Text prompts, stop strings and eos through the handle, many threads, overlap with the shipped
/// model's trained gates: each request's text, tokens and finish reason equal the request run
/// alone without overlap.
#[test]
fn handle_text_stop_strings_under_overlap_match_solo() {
    bounded("text_stop_overlap", LIMIT * 3, || {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro"));
        let texts = ["The borrow checker", "fn main() {", "Ownership in Rust means", "let x = ", "A trait is", "impl Drop for"];
        for gate in ["lookahead", "preloop", "delayed"] {
            let make = |w: usize| {
                let (g, overlap) = ponder::looped::gate::ouro_gate(&dir, gate, 0.5).unwrap();
                assert!(overlap);
                EngineBuilder::new(&dir)
                    .max_num_seqs(w)
                    .block_size(4)
                    .looped(move |o| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(KvLayoutKind::Shared).exit_gate_boxed(g))
            };
            let mut solo = make(1).build().unwrap();
            // Stop strings from each plain output: a 2-char piece from its middle, and an unmatched one.
            let mut cases = Vec::new();
            for (i, t) in texts.iter().enumerate() {
                let plain = solo.generate([*t], &GenerationParams::greedy(16)).unwrap().remove(0).unwrap();
                let chars: Vec<char> = plain.text.chars().collect();
                let mid = chars.len() / 2;
                let stop: String = chars[mid..(mid + 2).min(chars.len())].iter().collect();
                let stops = if i % 2 == 0 { vec![stop, "zzqq".to_string()] } else { vec!["zzqq".to_string()] };
                let params = GenerationParams { stop: stops, ignore_eos: i % 3 == 0, ..GenerationParams::greedy(16) };
                cases.push((t.to_string(), params));
            }
            let want: Vec<ponder::Output> = cases.iter().map(|(t, p)| solo.generate([t.as_str()], p).unwrap().remove(0).unwrap()).collect();
            let handle = Arc::new(make(4).looped(|o| o.overlap(true)).spawn().unwrap());
            submit_all_and_match(handle, cases, &want, gate);
        }
    });
}

/// An exit gate that panics on its n-th decision (a broken plug-in).
#[derive(Debug)]
struct PanicsAfter {
    n: Arc<AtomicUsize>,
}
impl ExitGate for PanicsAfter {
    fn name(&self) -> String {
        "panics-after".into()
    }
    fn bounds(&self) -> ponder::looped::gate::StepBounds {
        ponder::looped::gate::StepBounds::new(1, 4).unwrap()
    }
    fn decide(&self, _: ponder::looped::gate::ItemRef, step: usize, _: ponder::looped::gate::StepSignals, _: &mut ponder::looped::gate::GateState) -> bool {
        if self.n.fetch_sub(1, Ordering::SeqCst) == 1 {
            panic!("plug-in failure");
        }
        step >= 1
    }
}

/// A plug-in that panics on the engine thread: readers end (no hang), the handle's calls are
/// `EngineStopped`, and dropping the handle returns. Reports how the streams ended.
#[test]
fn a_panicking_plug_in_on_the_engine_thread_does_not_hang_callers() {
    bounded("panicking_plugin", LIMIT * 2, || {
        let (_tmp, dir) = tiny_dir(66);
        let gate = PanicsAfter { n: Arc::new(AtomicUsize::new(40)) };
        let handle = builder(&dir, KvLayoutKind::LastExited, 3).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(gate)).spawn().unwrap();
        let mut streams: Vec<_> = prompts(4, 1).into_iter().map(|p| handle.submit(p, GenerationParams::greedy(50)).unwrap()).collect();
        let collected = streams.pop().unwrap();
        let collected = std::thread::spawn(move || collected.collect_output());
        let readers: Vec<_> = streams.into_iter().map(|s| std::thread::spawn(move || s.collect::<Vec<Event>>())).collect();
        let deadline = Instant::now() + Duration::from_secs(LIMIT);
        let mut endings = Vec::new();
        for r in readers {
            while !r.is_finished() {
                assert!(Instant::now() < deadline, "a reader hangs after the engine thread panicked");
                std::thread::sleep(Duration::from_millis(10));
            }
            let evs = r.join().unwrap();
            endings.push(match evs.last() {
                Some(Event::Finished { reason, .. }) => format!("Finished({reason:?})"),
                Some(Event::Token { .. }) => format!("ended after {} tokens with no Finished event", evs.len()),
                None => "ended with no event".into(),
            });
        }
        let out = collected.join().unwrap();
        endings.push(format!("collect_output: {} tokens, finish_reason {:?}", out.token_ids.len(), out.finish_reason));
        eprintln!("stream endings after the plug-in panicked: {endings:?}");
        assert!(matches!(handle.submit(vec![1u32], GenerationParams::greedy(2)), Err(Error::EngineStopped)));
        assert!(matches!(handle.metrics(), Err(Error::EngineStopped)));
        assert!(matches!(handle.abort(RequestId(0)), Err(Error::EngineStopped)));
        bounded("drop", LIMIT, move || drop(handle));
        assert!(endings.iter().all(|e| e.starts_with("Finished") || e.contains("Error(")), "streams ended without a Finished event: {endings:?}");
    });
}

/// Chaos through the handle: 6 submitters, a thread aborting random ids (anyone's, unknown ones
/// too), a thread dropping streams part-way, a metrics poller; repeated. Every stream ends with
/// exactly one `Finished`; completed ones equal sequential output, aborted ones are prefixes; the
/// engine ends idle with no KV, and drops.
fn handle_chaos(label: &'static str, make: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync>, ps: Vec<Vec<u32>>, max_new: usize, rounds: u64) {
    let want = Arc::new(sequential(&mut make(1).build().unwrap(), &ps, &vec![max_new; ps.len()]));
    for round in 0..rounds {
        let handle = Arc::new(make(5).spawn().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let max_id = Arc::new(AtomicUsize::new(0));
        let mut joins = Vec::new();
        for t in 0..6u64 {
            let (h, ps, want, max_id) = (handle.clone(), ps.clone(), want.clone(), max_id.clone());
            joins.push(std::thread::spawn(move || {
                let mut r = Lcg(round * 1000 + t);
                let mut streams = Vec::new();
                for _ in 0..6 {
                    let i = r.below(ps.len() as u64) as usize;
                    let s = h.submit(ps[i].clone(), GenerationParams::greedy(max_new)).unwrap();
                    max_id.fetch_max(s.id.0 as usize, Ordering::SeqCst);
                    streams.push((i, s));
                }
                for (k, (i, mut s)) in streams.into_iter().enumerate() {
                    if t == 5 && k % 2 == 0 {
                        // The dropper: reads 0–2 events, drops.
                        for _ in 0..(k % 3) {
                            s.next();
                        }
                        continue;
                    }
                    let evs: Vec<Event> = s.by_ref().collect();
                    assert!(s.next().is_none(), "{label}: a stream yields after its end");
                    let l = format!("{label} round {round} thread {t} prompt {i}");
                    let reason = one_finish(&evs, &l);
                    let got = tokens_of(&evs);
                    match reason {
                        FinishReason::Length | FinishReason::Eos => assert_eq!(got, want[i], "{l}"),
                        FinishReason::Aborted => assert!(want[i].starts_with(&got), "{l}: aborted, not a prefix"),
                        other => panic!("{l}: {other:?}"),
                    }
                }
            }));
        }
        let chaos = {
            let (h, stop, max_id) = (handle.clone(), stop.clone(), max_id.clone());
            std::thread::spawn(move || {
                let mut r = Lcg(round + 77);
                while !stop.load(Ordering::SeqCst) {
                    let hi = max_id.load(Ordering::SeqCst) as u64 + 3;
                    let _ = h.abort(RequestId(r.below(hi)));
                    if r.chance(30) {
                        let m = h.metrics().unwrap();
                        assert!(m.kv_blocks_used <= m.kv_pool.blocks);
                    }
                    std::thread::sleep(Duration::from_millis(r.below(4)));
                }
            })
        };
        let deadline = Instant::now() + Duration::from_secs(LIMIT);
        let mut failure = None;
        for j in joins {
            while !j.is_finished() {
                if Instant::now() > deadline {
                    stop.store(true, Ordering::SeqCst);
                    panic!("{label} round {round}: a client thread hung");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if let Err(p) = j.join() {
                failure.get_or_insert(p);
            }
        }
        stop.store(true, Ordering::SeqCst);
        chaos.join().unwrap();
        if let Some(p) = failure {
            std::panic::resume_unwind(p);
        }
        let m = wait_handle_idle(&handle, label);
        if round == 0 {
            eprintln!("{label}: preemptions {} finished {} generated {}", m.preemptions, m.finished_requests, m.generated_tokens);
        }
        let h = Arc::try_unwrap(handle).ok().expect("only this thread holds the handle");
        bounded(label, LIMIT, move || drop(h));
    }
}

#[test]
fn handle_chaos_looped() {
    bounded("chaos_looped", LIMIT * 6, || {
        let (tmp, dir) = tiny_dir(67);
        let d = dir.clone();
        let cb: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync> = Arc::new(move |w| {
            if w > 1 {
                builder(&d, KvLayoutKind::Shared, w).max_num_batched_tokens(8).kv_capacity_tokens(64)
            } else {
                builder(&d, KvLayoutKind::Shared, w)
            }
        });
        handle_chaos("cb shared small pool", cb, prompts(10, 3), 20, 6);
        for c in [overlap_cfgs()[0].clone(), overlap_cfgs()[4].clone()] {
            let d = dir.clone();
            let make: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync> =
                Arc::new(move |w| if w > 1 { cfg_builder(&d, &c, w).kv_capacity_tokens(100).looped(|o| o.overlap(true)) } else { cfg_builder(&d, &c, w) });
            handle_chaos("depth overlap small pool", make, prompts(10, 4), 20, 6);
        }
        drop(tmp);
    });
}

#[test]
fn handle_chaos_diffusion() {
    bounded("chaos_diffusion", LIMIT * 6, || {
        use ponder::testing::*;
        let tmp = Arc::new(tempfile::tempdir().unwrap());
        let sdar = tmp.path().join("sdar");
        write_random_sdar(&sdar, &tiny_sdar_config(VOCAB), 3).unwrap();
        let llada = tmp.path().join("llada");
        write_random_llada(&llada, &tiny_llada_config(VOCAB), 4).unwrap();
        for (label, dir) in [("sdar", sdar), ("llada", llada)] {
            let llada = label == "llada";
            let make: Arc<dyn Fn(usize) -> EngineBuilder + Send + Sync> = Arc::new(move |w| {
                EngineBuilder::new(&dir).block_size(4).max_num_seqs(w).max_num_batched_tokens(24).kv_capacity_tokens(if w > 1 { 80 } else { 1024 }).diffusion(
                    move |o| {
                        let o = o.block_length(4).delayed_cache(true);
                        if llada {
                            o.canvas_cache(ponder::diffusion::CanvasCache::Prefix)
                        } else {
                            o
                        }
                    },
                )
            });
            handle_chaos(label, make, diffusion_prompts(10, 7), 12, 4);
        }
    });
}

/// The randomised sequences over two CPU ranks (tensor parallelism): overlap toggled, aborts,
/// preemption; and a handle over ranks dropped while its streams are read.
#[test]
fn fuzz_tensor_parallel_and_drop() {
    bounded("fuzz_tp", LIMIT * 6, || {
        let (_tmp, dir) = tiny_dir_with_eos(58, &[55, 23]);
        let c = overlap_cfgs()[1].clone();
        let d = dir.clone();
        let make = move |w: usize| cfg_builder(&d, &c, w).tensor_parallel(2).kv_capacity_tokens(if w > 1 { 4 * 90 } else { 4096 });
        for seed in 0..3 {
            fuzz_run("tp2 depth", &make, true, true, seed + 11, 40);
        }
        let d = dir.clone();
        let make =
            move |w: usize| builder(&d, KvLayoutKind::Shared, w).tensor_parallel(2).max_num_batched_tokens(8).kv_capacity_tokens(if w > 1 { 48 } else { 4096 });
        for seed in 0..3 {
            fuzz_run("tp2 cb", &make, true, false, seed + 21, 40);
        }
        let tmp = tempfile::tempdir().unwrap();
        let sdar = tmp.path().join("sdar");
        ponder::testing::write_random_sdar(&sdar, &ponder::testing::tiny_sdar_config(VOCAB), 3).unwrap();
        let s2 = sdar.clone();
        let make = move |w: usize| {
            EngineBuilder::new(&s2)
                .tensor_parallel(2)
                .block_size(4)
                .max_num_seqs(w)
                .kv_capacity_tokens(if w > 1 { 96 } else { 1024 })
                .diffusion(|o| o.block_length(4))
        };
        for seed in 0..3 {
            fuzz_run("tp2 sdar", &make, false, false, seed + 31, 40);
        }
        for (name, b) in [
            ("tp2 depth overlap", cfg_builder(&dir, &overlap_cfgs()[0], 3).tensor_parallel(2).looped(|o| o.overlap(true))),
            ("tp2 sdar", EngineBuilder::new(&sdar).tensor_parallel(2).block_size(4).max_num_seqs(3).diffusion(|o| o.block_length(4))),
        ] {
            let handle = b.spawn().unwrap();
            let ps = diffusion_prompts(4, 5);
            let readers: Vec<_> = ps
                .into_iter()
                .map(|p| handle.submit(p, GenerationParams { ignore_eos: true, ..GenerationParams::greedy(300) }).unwrap())
                .map(|s| std::thread::spawn(move || s.collect::<Vec<Event>>()))
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            let t = Instant::now();
            drop(handle);
            let deadline = Instant::now() + Duration::from_secs(LIMIT);
            for r in readers {
                while !r.is_finished() {
                    assert!(Instant::now() < deadline, "{name}: a reader hangs after the handle was dropped");
                    std::thread::sleep(Duration::from_millis(10));
                }
                let evs = r.join().unwrap();
                one_finish(&evs, name);
            }
            eprintln!("{name}: dropped in {:?}", t.elapsed());
        }
    });
}

/// An engine dropped with a launch in flight (overlap), over two ranks and on one device; then
/// another engine on the same checkpoint serves normally.
#[test]
fn dropping_an_engine_with_a_launch_in_flight() {
    bounded("drop_engine_in_flight", LIMIT * 2, || {
        let (_tmp, dir) = tiny_dir(68);
        for tp in [1usize, 2] {
            for k in 1..5 {
                let mut e = cfg_builder(&dir, &overlap_cfgs()[0], 3).tensor_parallel(tp).build().unwrap();
                e.set_overlap(true).unwrap();
                for p in prompts(3, 2) {
                    e.add_request(p, GenerationParams::greedy(20)).unwrap();
                }
                for _ in 0..k {
                    e.step().unwrap();
                }
                let t = Instant::now();
                drop(e);
                assert!(t.elapsed() < Duration::from_secs(10), "tp {tp}: drop took {:?}", t.elapsed());
            }
            let mut e = cfg_builder(&dir, &overlap_cfgs()[0], 3).tensor_parallel(tp).build().unwrap();
            let out = e.generate([vec![1u32, 2]], &GenerationParams::greedy(3)).unwrap().remove(0).unwrap();
            assert_eq!(out.token_ids.len(), 3);
            assert_idle(&e, "after drops");
        }
    });
}

/// A custom scheduler that admits requests but launches nothing in a launch: rows empty.
#[derive(Default)]
struct EmptyLaunches;
impl ponder::looped::LoopedScheduler for EmptyLaunches {
    fn name(&self) -> &'static str {
        "empty-launches"
    }
    fn schedule(&mut self, requests: &mut ponder::scheduler::Requests) -> Option<ponder::looped::LoopedLaunch> {
        while let Some(r) = requests.front() {
            let need = r.prompt.len() + r.max_new_tokens;
            requests.admit_front(need)?;
        }
        Some(ponder::looped::LoopedLaunch {
            stage: ponder::looped::Stage::Prefill,
            step_slots: vec![0, 1, 2, 3],
            rows: vec![],
            kv_copies: vec![],
            reenter: false,
        })
    }
    fn complete(&mut self, _: &mut ponder::scheduler::Requests, _: &ponder::looped::LoopedLaunch, _: &ponder::looped::LoopedResult) {}
    fn finished(&mut self, _: RequestId) {}
}

/// A scheduler whose every launch is empty (nothing to run, like `Stuck`, but as a launch):
/// the engine's requests should fail (as a stalled scheduler's do), not stay live forever.
#[test]
fn a_scheduler_that_launches_empty_launches_fails_its_requests() {
    bounded("empty_launches_engine", LIMIT, || {
        let (_tmp, dir) = tiny_dir(69);
        let mut e = builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.custom_scheduler(|_| Box::new(EmptyLaunches))).build().unwrap();
        let r = e.generate([vec![1u32, 2]], &GenerationParams::greedy(3));
        eprintln!("generate: {r:?}; live afterwards {}, KV used {}", e.num_unfinished(), e.requests().kv().num_used_blocks());
        let mut errors = 0;
        for _ in 0..20 {
            if e.step().is_err() {
                errors += 1;
            }
        }
        eprintln!("20 more steps: {errors} errors; live {}, KV used {}", e.num_unfinished(), e.requests().kv().num_used_blocks());
        assert!(
            !e.has_work() && e.num_unfinished() == 0,
            "the request stays live forever (each step an error), holding {} KV blocks",
            e.requests().kv().num_used_blocks()
        );
    });
}

#[test]
fn a_scheduler_that_launches_empty_launches_ends_handle_streams() {
    bounded("empty_launches_handle", LIMIT, || {
        let (_tmp, dir) = tiny_dir(69);
        let handle = builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.custom_scheduler(|_| Box::new(EmptyLaunches))).spawn().unwrap();
        let s = handle.submit(vec![1u32, 2], GenerationParams::greedy(3)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(s.collect_output());
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(out) => assert!(matches!(out.finish_reason, FinishReason::Error(_)), "the stream ended with {:?}", out.finish_reason),
            Err(_) => {
                // Dropping the handle still ends the spinning engine thread (Shutdown aborts all).
                let t = Instant::now();
                bounded("drop", LIMIT, move || drop(handle));
                let out = rx.recv_timeout(Duration::from_secs(5)).expect("the stream ends once the handle is dropped");
                panic!(
                    "the stream did not end within 10 s (engine thread spinning on failing empty launches); the handle's drop ended it in {:?} with {:?}",
                    t.elapsed(),
                    out.finish_reason
                );
            }
        }
    });
}

/// Diffusion models with their tokenizers: text prompts, stop strings taken from the plain
/// output, eos, through the handle from many threads: each equal to the request run alone.
#[test]
fn diffusion_text_stop_strings_through_the_handle_match_solo() {
    bounded("diffusion_text_stop", LIMIT * 3, || {
        let texts = ["The borrow checker", "fn main() {", "Ownership in Rust means", "let x = ", "A trait is", "impl Drop for"];
        for asset in ["tiny-sdar", "tiny-llada"] {
            let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/assets")).join(asset);
            let make = |w: usize| EngineBuilder::new(&dir).max_num_seqs(w).block_size(4).kv_capacity_tokens(if w > 1 { 160 } else { 4096 });
            let mut solo = make(1).build().unwrap();
            let mut cases = Vec::new();
            for (i, t) in texts.iter().enumerate() {
                let plain = solo.generate([*t], &GenerationParams { ignore_eos: true, ..GenerationParams::greedy(20) }).unwrap().remove(0).unwrap();
                let chars: Vec<char> = plain.text.chars().collect();
                let mid = chars.len() / 3;
                let stop: String = chars[mid..(mid + 2).min(chars.len())].iter().collect();
                let stops = if i % 2 == 0 { vec!["zzqq".to_string(), stop] } else { vec![] };
                cases.push((t.to_string(), GenerationParams { stop: stops, ignore_eos: i % 3 != 0, ..GenerationParams::greedy(20) }));
            }
            let want: Vec<ponder::Output> = cases.iter().map(|(t, p)| solo.generate([t.as_str()], p).unwrap().remove(0).unwrap()).collect();
            let reasons: Vec<_> = want.iter().map(|w| format!("{:?}", w.finish_reason)).collect();
            eprintln!("{asset}: solo finish reasons {reasons:?}");
            let handle = Arc::new(make(4).spawn().unwrap());
            submit_all_and_match(handle, cases, &want, asset);
        }
    });
}

/// Through the handle, abort of unknown, finished and already-aborted ids: no panic, no effect
/// on others (the handle answers Ok: the engine thread's `UnknownRequest` is dropped). Recorded.
#[test]
fn handle_abort_of_unknown_finished_and_aborted_ids() {
    bounded("handle_abort_ids", LIMIT, || {
        let (_tmp, dir) = tiny_dir(70);
        let handle = builder(&dir, KvLayoutKind::DepthIndexed, 2).spawn().unwrap();
        let unknown = handle.abort(RequestId(u64::MAX));
        let done = handle.submit(vec![1u32, 2], GenerationParams::greedy(2)).unwrap();
        let done_id = done.id;
        assert_eq!(done.collect_output().finish_reason, FinishReason::Length);
        let finished = handle.abort(done_id);
        let mut s = handle.submit(vec![3u32], GenerationParams::greedy(300)).unwrap();
        s.next();
        let first = handle.abort(s.id);
        let second = handle.abort(s.id);
        let evs: Vec<Event> = s.collect();
        assert_eq!(one_finish(&evs, "aborted"), FinishReason::Aborted);
        let third = handle.abort(RequestId(evs[0].id().0));
        eprintln!("handle.abort: unknown {unknown:?}, finished {finished:?}, first {first:?}, second {second:?}, after end {third:?}");
        let m = wait_handle_idle(&handle, "abort ids");
        assert_eq!(m.kv_blocks_used, 0);
        bounded("drop", LIMIT, move || drop(handle));
    });
}

/// 16 threads × 12 submits into a width-2 engine with a small pool, read out of order (later
/// streams first): all equal sequential, engine idle afterwards.
#[test]
fn many_threads_many_submits_read_out_of_order() {
    bounded("many_submits", LIMIT * 3, || {
        let (_tmp, dir) = tiny_dir(71);
        let ps = prompts(16, 12);
        let want = Arc::new(sequential(&mut builder(&dir, KvLayoutKind::LastExited, 1).build().unwrap(), &ps, &vec![6; ps.len()]));
        let handle = Arc::new(builder(&dir, KvLayoutKind::LastExited, 2).kv_capacity_tokens(4 * 64).spawn().unwrap());
        let joins: Vec<_> = (0..16)
            .map(|t| {
                let (h, ps, want) = (handle.clone(), ps.clone(), want.clone());
                std::thread::spawn(move || {
                    let streams: Vec<_> =
                        (0..12).map(|k| ((t + k) % ps.len(), h.submit(ps[(t + k) % ps.len()].clone(), GenerationParams::greedy(6)).unwrap())).collect();
                    for (i, s) in streams.into_iter().rev() {
                        assert_eq!(s.collect_output().token_ids, want[i]);
                    }
                })
            })
            .collect();
        for j in joins {
            j.join().unwrap();
        }
        let m = wait_handle_idle(&handle, "many submits");
        eprintln!("many submits: preemptions {}, finished {}", m.preemptions, m.finished_requests);
        assert_eq!(m.finished_requests, 16 * 12);
        let h = Arc::try_unwrap(handle).ok().unwrap();
        bounded("drop", LIMIT, move || drop(h));
    });
}

/// Submits every case from a thread of its own and checks each output against `want` (the
/// requests run alone); then the handle ends idle and drops.
fn submit_all_and_match(handle: Arc<EngineHandle>, cases: Vec<(String, GenerationParams)>, want: &[ponder::Output], label: &str) {
    let joins: Vec<_> = cases
        .into_iter()
        .enumerate()
        .map(|(i, (t, p))| {
            let h = handle.clone();
            std::thread::spawn(move || (i, h.submit(t.as_str(), p).unwrap().collect_output()))
        })
        .collect();
    for j in joins {
        let (i, got) = j.join().unwrap();
        let w = &want[i];
        assert_eq!((&got.token_ids, &got.text, &got.finish_reason), (&w.token_ids, &w.text, &w.finish_reason), "{label} request {i}");
    }
    wait_handle_idle(&handle, label);
    let h = Arc::try_unwrap(handle).ok().unwrap();
    bounded("drop", LIMIT, move || drop(h));
}
