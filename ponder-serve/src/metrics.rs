//! `GET /metrics`: the engine's counters in the Prometheus text format.

use ponder::engine::LatencyHistogram;
use ponder::EngineMetrics;
use std::fmt::Write;
use std::time::Duration;

/// Upper bounds of the latency histograms' buckets, in seconds.
const LATENCY_BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in samples {
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}

fn latency(out: &mut String, name: &str, help: &str, h: &LatencyHistogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for b in LATENCY_BUCKETS {
        let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", h.count_within(Duration::from_secs_f64(b)));
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", h.count(), h.sum().as_secs_f64(), h.count());
}

/// The text a scrape gets.
pub fn render(m: &EngineMetrics) -> String {
    let mut out = String::new();
    let one = |v: f64| vec![(String::new(), v)];
    metric(&mut out, "ponder_requests_running", "gauge", "Requests admitted and not finished.", &one(m.running_requests as f64));
    metric(&mut out, "ponder_requests_waiting", "gauge", "Requests waiting for admission.", &one(m.waiting_requests as f64));
    metric(&mut out, "ponder_kv_blocks_used", "gauge", "KV cache blocks held by running requests.", &one(m.kv_blocks_used as f64));
    metric(&mut out, "ponder_kv_blocks_total", "gauge", "KV cache blocks in the pool.", &one(m.kv_pool.blocks as f64));
    metric(&mut out, "ponder_generated_tokens_total", "counter", "Tokens handed to requests (eos excluded).", &one(m.generated_tokens as f64));
    metric(&mut out, "ponder_finished_requests_total", "counter", "Requests that finished (eos, stop, length).", &one(m.finished_requests as f64));
    metric(&mut out, "ponder_preemptions_total", "counter", "Requests preempted and recomputed later.", &one(m.preemptions as f64));
    latency(&mut out, "ponder_time_to_first_token_seconds", "From a request's admission to its first token.", &m.time_to_first_token);
    latency(&mut out, "ponder_inter_token_latency_seconds", "Between consecutive tokens of a request.", &m.inter_token_latency);
    let stages = |f: &dyn Fn(&ponder::engine::StageStats) -> f64| m.stages.iter().map(|(k, s)| (format!("{{stage=\"{k}\"}}"), f(s))).collect::<Vec<_>>();
    metric(&mut out, "ponder_launches_total", "counter", "Launches run, per stage.", &stages(&|s| s.launches as f64));
    metric(&mut out, "ponder_launch_rows_total", "counter", "Rows of the launches, per stage.", &stages(&|s| s.rows as f64));
    metric(&mut out, "ponder_launch_seconds_total", "counter", "Wall time of the launches, per stage.", &stages(&|s| s.time.as_secs_f64()));
    if let Some(l) = m.looped() {
        // The depth histogram as a Prometheus histogram of loop steps per token.
        let _ =
            writeln!(out, "# HELP ponder_token_loop_steps Loop steps each generated token ran (depth schedulers).\n# TYPE ponder_token_loop_steps histogram");
        let mut seen = 0;
        for (d, c) in l.depth_histogram.iter().enumerate() {
            seen += c;
            let _ = writeln!(out, "ponder_token_loop_steps_bucket{{le=\"{}\"}} {seen}", d + 1);
        }
        let sum: u64 = l.depth_histogram.iter().enumerate().map(|(d, c)| (d as u64 + 1) * c).sum();
        let _ = writeln!(out, "ponder_token_loop_steps_bucket{{le=\"+Inf\"}} {seen}\nponder_token_loop_steps_sum {sum}\nponder_token_loop_steps_count {seen}");
    }
    if let Some(d) = m.denoise() {
        metric(&mut out, "ponder_denoise_steps_total", "counter", "Denoising steps run (one request's step over its block).", &one(d.steps as f64));
        metric(&mut out, "ponder_denoise_step_tokens_total", "counter", "Tokens the denoising steps ran through the network.", &one(d.step_tokens as f64));
    }
    out
}
