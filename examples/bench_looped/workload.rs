//! The suite-cdb workload (seeded lognormal lengths, random prompt ids) and one offline run
//! measured over its steady-state window.

use crate::random_ids;
use ponder::GenerationParams;
use std::time::Instant;

/// A request of the cdb workload.
pub(crate) struct Job {
    pub(crate) prompt: Vec<u32>,
    pub(crate) new_tokens: usize,
}

fn lognormal(median: f64, sigma: f64, lo: usize, hi: usize, x: &mut u64) -> usize {
    let mut uniform = || {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        ((*x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let z = (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos();
    ((median * (sigma * z).exp()).round() as usize).clamp(lo, hi)
}

/// Lengths of the suite-cdb workload: lognormal prompt and output lengths (median, σ, clipped
/// to 8..=max). The defaults are ShareGPT-like with short outputs: about half of all tokens are
/// prompt tokens, which run full depth in every mode.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lengths {
    pub(crate) prompt_median: f64,
    pub(crate) prompt_max: usize,
    pub(crate) output_median: f64,
    pub(crate) output_max: usize,
}

impl Default for Lengths {
    fn default() -> Self {
        Self { prompt_median: 128.0, prompt_max: 512, output_median: 160.0, output_max: 256 }
    }
}

impl Lengths {
    const PROMPT_SIGMA: f64 = 0.9;
    const OUTPUT_SIGMA: f64 = 0.7;

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt": { "median": self.prompt_median, "sigma": Self::PROMPT_SIGMA, "min": 8, "max": self.prompt_max },
            "output": { "median": self.output_median, "sigma": Self::OUTPUT_SIGMA, "min": 8, "max": self.output_max },
        })
    }
}

pub(crate) fn workload(n: usize, vocab: usize, max_context: usize, seed: u64, len: Lengths) -> Vec<Job> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            let p = lognormal(len.prompt_median, Lengths::PROMPT_SIGMA, 8, len.prompt_max.min(max_context / 2), &mut x);
            let o = lognormal(len.output_median, Lengths::OUTPUT_SIGMA, 8, len.output_max.min(max_context / 2), &mut x);
            Job { prompt: random_ids(p, vocab, seed ^ (i as u64 + 1) * 7919), new_tokens: o }
        })
        .collect()
}

/// Outcome of one offline run.
pub(crate) struct RunStats {
    pub(crate) window_tokens_per_s: f64,
    pub(crate) whole_tokens_per_s: f64,
    pub(crate) mean_depth: f64,
    /// GPU idle share of the run: exact from device spans (`idle_exact`), else an upper bound
    /// over the launches from the host's waits.
    pub(crate) idle: f64,
    pub(crate) idle_exact: bool,
    pub(crate) stages: serde_json::Value,
}

/// Device seconds of one stage in a run's `stages` JSON (with `--time-device`).
pub(crate) fn stage_device(stages: &serde_json::Value, name: &str) -> Option<f64> {
    stages.get(name)?.get("device_s")?.as_f64()
}

/// Runs `jobs` offline (all queued at once) and measures the steady-state window. With
/// `drain` false the requests still running when the window closes are aborted there: the
/// drain is outside the window, and with long outputs it is a large share of the device time.
pub(crate) fn offline(engine: &mut ponder::Engine, jobs: &[Job], width: usize, drain: bool) -> Result<RunStats, Box<dyn std::error::Error>> {
    let before = engine.metrics().clone();
    let mut unfinished = std::collections::HashSet::new();
    for j in jobs {
        let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(j.new_tokens) };
        unfinished.insert(engine.add_request(j.prompt.clone(), params)?);
    }
    let start = Instant::now();
    let (mut tokens, mut done) = (0u64, 0usize);
    let mut window_open: Option<(Instant, u64)> = None;
    let mut window: Option<(f64, u64)> = None;
    while engine.has_work() {
        for ev in engine.step()? {
            match ev {
                ponder::Event::Token { .. } => tokens += 1,
                ponder::Event::Finished { id, .. } => {
                    done += 1;
                    unfinished.remove(&id);
                }
            }
        }
        if window_open.is_none() && done >= width {
            window_open = Some((Instant::now(), tokens));
        }
        if window.is_none() && engine.scheduler().num_waiting() == 0 {
            if let Some((t0, k0)) = window_open {
                window = Some((t0.elapsed().as_secs_f64(), tokens - k0));
                if !drain {
                    for id in unfinished.drain() {
                        // A request whose Finished event is still pending is no longer live.
                        match engine.abort(id) {
                            Ok(()) | Err(ponder::Error::UnknownRequest(_)) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
            }
        }
    }
    let total = start.elapsed().as_secs_f64();
    let whole = tokens as f64 / total;
    let win = match window {
        Some((secs, k)) if secs >= 0.2 * total => k as f64 / secs,
        _ => whole,
    };
    let m = engine.metrics();
    let mut stages = serde_json::Map::new();
    let mut wait = 0.0;
    let mut time = 0.0;
    let mut device_total = 0.0;
    let mut all_timed = !m.stages.is_empty();
    for (name, s) in &m.stages {
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
                                "device_s": timed.then_some(device), "device_forward_s": timed.then_some(forward) }),
        );
    }
    let hist: Vec<u64> = m.depth_histogram.iter().zip(before.depth_histogram.iter().chain(std::iter::repeat(&0))).map(|(a, b)| a - b).collect();
    let n: u64 = hist.iter().sum();
    let mean_depth = if n == 0 { 0.0 } else { hist.iter().enumerate().map(|(i, c)| (i as u64 + 1) * c).sum::<u64>() as f64 / n as f64 };
    // With device spans the idle share is exact: the device works only inside launch spans.
    let idle = if all_timed {
        1.0 - device_total / total
    } else if time > 0.0 {
        1.0 - wait / time
    } else {
        0.0
    };
    Ok(RunStats { window_tokens_per_s: win, whole_tokens_per_s: whole, mean_depth, idle, idle_exact: all_timed, stages: stages.into() })
}
