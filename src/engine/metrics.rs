//! Counters the engine keeps while it runs.

pub use super::latency::LatencyHistogram;
use std::collections::BTreeMap;
use std::time::Duration;

/// Launch statistics of one stage.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageStats {
    pub launches: u64,
    pub rows: u64,
    pub tokens: u64,
    /// Wall time of the launches, including the sync that brings sampled ids to the host.
    pub time: Duration,
    /// Part of `time` the host spent blocked waiting for the device to finish the launch.
    /// The device is busy at least this long, so `1 − wait / time` bounds its idle share.
    pub wait: Duration,
    /// Device-side span of the launches — from the device reaching a launch's first kernel to
    /// the end of its last — when `LoopedOptions::time_device` is on (CUDA); zero otherwise.
    /// Unlike `wait` it is exact under overlap, where a launch's wait covers the work queued
    /// ahead of it.
    pub device_time: Duration,
    /// Part of `device_time` in the model's forward (its CUDA graph or eager kernels); the rest
    /// is sampling, eager re-entry and the copies of results to the host.
    pub device_forward: Duration,
    /// Launches whose device-side span was measured.
    pub device_timed: u64,
    /// Looped models: what the launches read and computed, counted from their rows
    /// ([`crate::engine::LaunchCost`]); zero for diffusion launches.
    pub cost: LaunchCost,
}

/// Device-side span of one launch (see [`StageStats::device_time`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceSpan {
    pub total: Duration,
    /// From the launch's start to the end of its forward.
    pub forward: Duration,
}

/// The KV pool an engine built (see [`crate::EngineBuilder::kv_memory_fraction`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvPoolStats {
    pub blocks: usize,
    pub block_size: usize,
    /// Cache slots per request (loop steps map onto slots; 1 for diffusion models).
    pub slots: usize,
    /// Positions across every slot: `blocks × block_size`. A request of n positions takes n per
    /// slot.
    pub tokens: usize,
    /// Device bytes of the K and V tensors.
    pub bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// The KV pool this engine allocated.
    pub kv_pool: KvPoolStats,
    pub stages: BTreeMap<&'static str, StageStats>,
    /// Tokens handed to requests (eos excluded).
    pub generated_tokens: u64,
    pub finished_requests: u64,
    pub preemptions: u64,
    /// `depth_histogram[d - 1]`: generated tokens that ran `d` loop steps (depth schedulers;
    /// a request's first token comes from the full-depth prefill and counts at r_max).
    pub depth_histogram: Vec<u64>,
    /// Looped models with CUDA graphs: decode graphs captured, and launches replayed from one.
    pub graph_captures: usize,
    pub graph_replays: usize,
    /// CUDA: the kernel paths this engine's launches dispatched (eager launches and graph
    /// captures).
    pub kernels: crate::ops::KernelCounts,
    /// Diffusion models: what the denoise launches carried.
    pub denoise: DenoiseStats,
    /// Per request, from its admission to its first token event.
    pub time_to_first_token: LatencyHistogram,
    /// Between consecutive token events of one request (tokens a diffusion step finalises
    /// together count as arriving together).
    pub inter_token_latency: LatencyHistogram,
}

/// Row counts of denoise launches. A *step* is one request's denoising step over its block.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DenoiseStats {
    pub steps: u64,
    /// Tokens the steps ran through every layer (the recomputed positions; with the delayed
    /// cache fewer than the block).
    pub step_tokens: u64,
    /// Masked tokens whose logits the steps read out.
    pub readouts: u64,
    /// Prompt prefill and clean-K/V rows (no readout), and their tokens.
    pub other_rows: u64,
    pub other_tokens: u64,
    /// Steps an eviction policy scored, their tokens, and the tokens kept past layer 1.
    pub scored_steps: u64,
    pub scored_tokens: u64,
    pub kept_tokens: u64,
    /// `(tokens revealed under an eviction policy, of them in the step's kept set)`.
    pub revealed: u64,
    pub revealed_kept: u64,
    /// Wall time per phase of the denoise launches (embedding, layers, FOCUS selection and
    /// compaction, LM head + readout), when `DiffusionOptions::time_denoise_phases` is on.
    pub phases: Vec<(&'static str, Duration)>,
}

impl DenoiseStats {
    /// Mean tokens a request's step runs through the network (through layer 1 when evicting).
    pub fn tokens_per_step(&self) -> f64 {
        self.step_tokens as f64 / self.steps.max(1) as f64
    }
    /// Mean tokens a scored step kept past layer 1 (FOCUS's "kept per step").
    pub fn kept_per_step(&self) -> f64 {
        self.kept_tokens as f64 / self.scored_steps.max(1) as f64
    }
    /// Share of scored steps' tokens that skipped layers ≥ 1.
    pub fn eviction_ratio(&self) -> f64 {
        1.0 - self.kept_tokens as f64 / self.scored_tokens.max(1) as f64
    }
    /// Share of revealed tokens that were in their step's kept set: 1 by construction when
    /// evicting; in shadow mode FOCUS's recall of the tokens the baseline decodes.
    pub fn recall(&self) -> Option<f64> {
        (self.revealed > 0).then(|| self.revealed_kept as f64 / self.revealed as f64)
    }
}

impl EngineMetrics {
    /// Realised mean exit depth d̄ (0 when no depth scheduler reports one).
    pub fn mean_depth(&self) -> f64 {
        let n: u64 = self.depth_histogram.iter().sum();
        let s: u64 = self.depth_histogram.iter().enumerate().map(|(i, c)| (i as u64 + 1) * c).sum();
        if n == 0 {
            0.0
        } else {
            s as f64 / n as f64
        }
    }
}

impl EngineMetrics {
    pub(crate) fn record_denoise(&mut self, launch: &crate::diffusion::DenoiseLaunch, result: &crate::diffusion::DenoiseResult) {
        let d = &mut self.denoise;
        for (row, out) in launch.rows.iter().zip(&result.rows) {
            if row.readout.is_empty() {
                d.other_rows += 1;
                d.other_tokens += row.tokens.len() as u64;
            } else {
                d.steps += 1;
                d.step_tokens += row.tokens.len() as u64;
                d.readouts += row.readout.len() as u64;
            }
            if let Some(k) = &out.kept {
                d.scored_steps += 1;
                d.scored_tokens += row.tokens.len() as u64;
                d.kept_tokens += k.len() as u64;
            }
        }
    }

    /// FOCUS's recall of decodable tokens (see [`DenoiseStats::recall`]).
    pub fn eviction_recall(&self) -> Option<f64> {
        self.denoise.recall()
    }

    /// Generated tokens per request-step (diffusion: how many tokens a step decodes on average).
    pub fn tokens_per_denoise_step(&self) -> f64 {
        self.generated_tokens as f64 / self.denoise.steps.max(1) as f64
    }

    pub(crate) fn record_device(&mut self, stage: &'static str, span: DeviceSpan) {
        let s = self.stages.entry(stage).or_default();
        s.device_time += span.total;
        s.device_forward += span.forward;
        s.device_timed += 1;
    }

    pub(crate) fn record(&mut self, stage: &'static str, rows: usize, tokens: usize, time: Duration, wait: Duration, cost: Option<LaunchCost>) {
        let s = self.stages.entry(stage).or_default();
        if let Some(c) = cost {
            s.cost.add(&c);
        }
        s.launches += 1;
        s.rows += rows as u64;
        s.tokens += tokens as u64;
        s.time += time;
        s.wait += wait;
    }

    /// Upper bound on the device's idle share over all launches: wall time the host was not
    /// blocked on the device (building batches, enqueueing kernels, bookkeeping) over wall time.
    pub fn idle_upper_bound(&self) -> f64 {
        let time: f64 = self.stages.values().map(|s| s.time.as_secs_f64()).sum();
        let wait: f64 = self.stages.values().map(|s| s.wait.as_secs_f64()).sum();
        if time == 0.0 {
            0.0
        } else {
            1.0 - wait / time
        }
    }
}

/// Bytes and FLOPs of one launch (or a sum of launches).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LaunchCost {
    /// Weights read: every stage's parameters once per launch (a loop step's once per step).
    pub weight_bytes: u64,
    /// K/V read: per row and attention-layer application, its context length's K and V.
    pub kv_bytes: u64,
    /// Linear-layer FLOPs (2 per parameter and token; the head only at sampled rows) plus
    /// attention (QKᵀ and PV: 4 · heads · head_dim per query per visible key).
    pub flops: f64,
}

impl LaunchCost {
    pub fn bytes(&self) -> u64 {
        self.weight_bytes + self.kv_bytes
    }

    /// The launch's lower bound in seconds at `bandwidth` bytes/s and `peak` FLOP/s: the larger
    /// of streaming its bytes and computing its FLOPs.
    pub fn roofline_seconds(&self, bandwidth: f64, peak: f64) -> f64 {
        (self.bytes() as f64 / bandwidth).max(self.flops / peak)
    }

    /// What was counted after `earlier` (a snapshot of the same running sum).
    pub fn since(&self, earlier: &LaunchCost) -> LaunchCost {
        LaunchCost {
            weight_bytes: self.weight_bytes.saturating_sub(earlier.weight_bytes),
            kv_bytes: self.kv_bytes.saturating_sub(earlier.kv_bytes),
            flops: (self.flops - earlier.flops).max(0.0),
        }
    }

    pub fn add(&mut self, other: &LaunchCost) {
        self.weight_bytes += other.weight_bytes;
        self.kv_bytes += other.kv_bytes;
        self.flops += other.flops;
    }
}
