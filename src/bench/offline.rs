//! One offline run of a workload through an engine — every request queued at once, as the
//! CDB authors measure — with its figures taken over a steady-state window.

use super::Job;
use crate::{Engine, EngineMetrics, GenerationParams, Result};
use std::time::Instant;

/// Outcome of one offline run.
pub struct RunStats {
    pub window_tokens_per_s: f64,
    pub whole_tokens_per_s: f64,
    /// Completions inside the steady-state window; `None` when the run had none worth the
    /// name (shorter than 20 % of the run) and the window figures are the whole run's.
    pub window_completions: Option<usize>,
    pub mean_depth: f64,
    /// GPU idle share of the window (else the run): exact from device spans (`idle_exact`),
    /// else an upper bound over the launches from the host's waits.
    pub idle: f64,
    pub idle_exact: bool,
    /// Per-stage launches, rows and seconds over the window (else the run).
    pub stages: serde_json::Value,
}

/// Device seconds of one stage in a run's `stages` JSON (with `--time-device`).
pub fn stage_device(stages: &serde_json::Value, name: &str) -> Option<f64> {
    stages.get(name)?.get("device_s")?.as_f64()
}

/// Where a run's steady-state window lies.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// Completions before it opens: at least the most requests resident at once, so that the
    /// requests admitted together at the start have left and contexts are at their steady mix.
    pub open_after: usize,
    /// Completions after which it closes; it closes at the last admission in any case. Every
    /// mode compared should count the same number, so that each covers as much work.
    pub completions: Option<usize>,
    /// Run the workload to its end, or abort what still runs when the window closes (the drain
    /// lies outside the window and, with long outputs, is much of the device time).
    pub drain: bool,
}

/// Per-stage figures between two metric snapshots: the stages JSON, device seconds in all,
/// host seconds blocked on the device, host seconds in launches, whether every launch was timed.
fn stage_delta(after: &EngineMetrics, before: &EngineMetrics) -> (serde_json::Value, f64, f64, f64, bool) {
    let mut stages = serde_json::Map::new();
    let (mut wait, mut time, mut device_total) = (0.0, 0.0, 0.0);
    let mut all_timed = !after.stages.is_empty();
    for (name, s) in &after.stages {
        let b = before.stages.get(name).cloned().unwrap_or_default();
        let (t, w) = ((s.time - b.time).as_secs_f64(), (s.wait - b.wait).as_secs_f64());
        time += t;
        wait += w;
        let device = (s.device_time - b.device_time).as_secs_f64();
        let forward = (s.device_forward - b.device_forward).as_secs_f64();
        let timed = s.device_timed - b.device_timed == s.launches - b.launches;
        all_timed &= timed;
        device_total += device;
        stages.insert(
            name.to_string(),
            serde_json::json!({ "launches": s.launches - b.launches, "rows": s.rows - b.rows, "seconds": t, "device_wait_s": w,
                                "device_s": timed.then_some(device), "device_forward_s": timed.then_some(forward),
                                "weight_bytes": s.cost.since(&b.cost).weight_bytes, "kv_bytes": s.cost.since(&b.cost).kv_bytes,
                                "flops": s.cost.since(&b.cost).flops }),
        );
    }
    (stages.into(), device_total, wait, time, all_timed)
}

/// Runs `jobs` offline (all queued at once) and measures the steady-state window.
pub fn offline(engine: &mut Engine, jobs: &[Job], window: Window) -> Result<RunStats> {
    let before = engine.metrics().clone();
    let mut unfinished = std::collections::HashSet::new();
    for j in jobs {
        let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(j.new_tokens) };
        unfinished.insert(engine.add_request(j.prompt.clone(), params)?);
    }
    let start = Instant::now();
    let (mut tokens, mut done) = (0u64, 0usize);
    // At the open: when, tokens, completions, metrics. At the close: seconds, tokens and
    // completions inside the window, metrics.
    let mut open: Option<(Instant, u64, usize, EngineMetrics)> = None;
    let mut close: Option<(f64, u64, usize, EngineMetrics)> = None;
    while engine.has_work() {
        for ev in engine.step()? {
            super::fail_on_error(&ev)?;
            match ev {
                crate::Event::Token { .. } => tokens += 1,
                crate::Event::Finished { id, .. } => {
                    done += 1;
                    unfinished.remove(&id);
                }
            }
        }
        if open.is_none() && done >= window.open_after {
            open = Some((Instant::now(), tokens, done, engine.metrics().clone()));
        }
        let Some((t0, k0, d0, _)) = &open else { continue };
        let enough = window.completions.is_some_and(|c| done >= d0 + c);
        if close.is_none() && (enough || engine.requests().num_waiting() == 0) {
            close = Some((t0.elapsed().as_secs_f64(), tokens - k0, done - d0, engine.metrics().clone()));
            if !window.drain {
                for id in unfinished.drain() {
                    // A request whose Finished event is still pending is no longer live.
                    match engine.abort(id) {
                        Ok(()) | Err(crate::Error::UnknownRequest(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }
    let total = start.elapsed().as_secs_f64();
    let whole = tokens as f64 / total;
    let end = engine.metrics().clone();
    // The window's figures, or the whole run's where the window is too short to mean anything.
    let (window_tokens_per_s, window_completions, from, to, span) = match (&open, &close) {
        (Some((.., m0)), Some((secs, k, d, m1))) if *secs >= 0.2 * total => (*k as f64 / secs, Some(*d), m0, m1, *secs),
        _ => (whole, None, &before, &end, total),
    };
    let (stages, device_total, wait, time, all_timed) = stage_delta(to, from);
    let depths = |m: &crate::EngineMetrics| m.looped().map(|l| l.depth_histogram.clone()).unwrap_or_default();
    let (end_depths, before_depths) = (depths(&end), depths(&before));
    let hist: Vec<u64> = end_depths.iter().zip(before_depths.iter().chain(std::iter::repeat(&0))).map(|(a, b)| a - b).collect();
    let n: u64 = hist.iter().sum();
    let mean_depth = if n == 0 { 0.0 } else { hist.iter().enumerate().map(|(i, c)| (i as u64 + 1) * c).sum::<u64>() as f64 / n as f64 };
    // With device spans the idle share is exact: the device works only inside launch spans.
    let idle = if all_timed {
        1.0 - device_total / span
    } else if time > 0.0 {
        1.0 - wait / time
    } else {
        0.0
    };
    Ok(RunStats { window_tokens_per_s, whole_tokens_per_s: whole, window_completions, mean_depth, idle, idle_exact: all_timed, stages })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{workload, Lengths};
    use crate::looped::gate::{DepthTrace, Replay};
    use crate::testing::{huginn_tensor_manifest, random_tensors, tiny_huginn_config};
    use crate::{EngineBuilder, SchedulerKind};
    use candle_core::{DType, Device};

    const WIDTH: usize = 3;
    const RESERVE: usize = 2;

    /// Tiny Huginn under refill with a held coda and a reserve: up to WIDTH + RESERVE resident.
    fn engine() -> Engine {
        let cfg = tiny_huginn_config(512);
        let weights =
            crate::loader::Weights::from_map(random_tensors(&huginn_tensor_manifest(&cfg), 7, DType::F32, &Device::Cpu).unwrap(), DType::F32, &Device::Cpu);
        let model = crate::looped::models::Huginn::load(&cfg, &weights).unwrap();
        let steps = crate::looped::models::LoopedModel::spec(&model).max_steps;
        EngineBuilder::from_model(Box::new(model), None, vec![])
            .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(crate::KvLayoutKind::Shared))
            .max_num_seqs(WIDTH)
            .looped(|o| {
                o.min_coda_batch_size(WIDTH).coda_reserve(RESERVE).exit_gate(Replay::new(DepthTrace::with_mean(3.0, 2, steps, 5).unwrap(), 2, steps).unwrap())
            })
            .build()
            .unwrap()
    }

    fn jobs(n: usize) -> Vec<Job> {
        workload(n, 512, 1024, 3, Lengths { prompt_median: 12.0, prompt_max: 24, output_median: 10.0, output_max: 20 })
    }

    fn assert_idle(engine: &Engine) {
        assert!(!engine.has_work() && engine.num_unfinished() == 0);
        let kv = engine.requests().kv();
        assert_eq!((kv.num_used_blocks(), kv.num_resident()), (0, 0), "KV released");
    }

    #[test]
    fn window_closes_after_the_given_completions_and_the_rest_is_aborted() {
        let (mut engine, jobs) = (engine(), jobs(30));
        // Opens after 5 completions, closes after 12 more, well before the last admission (25).
        let window = Window { open_after: WIDTH + RESERVE, completions: Some(12), drain: false };
        let st = offline(&mut engine, &jobs, window).unwrap();
        let inside = st.window_completions.expect("a window");
        // Several requests can finish in one step, never more than are resident.
        assert!((12..12 + WIDTH + RESERVE).contains(&inside), "{inside} completions in the window");
        let requested: u64 = jobs.iter().map(|j| j.new_tokens as u64).sum();
        assert!(engine.metrics().generated_tokens < requested, "requests still running at the close were aborted");
        assert_idle(&engine);
    }

    #[test]
    fn drained_run_generates_everything_and_a_late_window_falls_back_to_the_whole_run() {
        let (mut engine, jobs) = (engine(), jobs(12));
        let requested: u64 = jobs.iter().map(|j| j.new_tokens as u64).sum();
        let st = offline(&mut engine, &jobs, Window { open_after: WIDTH + RESERVE, completions: None, drain: true }).unwrap();
        assert_eq!(engine.metrics().generated_tokens, requested);
        assert!(st.window_tokens_per_s > 0.0);
        assert_idle(&engine);
        // A window that would open after every request has finished cannot be measured.
        let st = offline(&mut engine, &jobs, Window { open_after: jobs.len() + 1, completions: None, drain: true }).unwrap();
        assert_eq!(st.window_completions, None);
        assert_eq!(st.window_tokens_per_s, st.whole_tokens_per_s);
        assert_idle(&engine);
    }
}
