//! Counters the engine keeps while it runs.

pub use super::latency::LatencyHistogram;
use crate::diffusion::DenoiseStats;
use crate::looped::LoopedMetrics;
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
    /// What the launches read and computed, where the model family counts it from their rows
    /// ([`crate::engine::LaunchCost`]); zero otherwise.
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

/// What an engine counted since it was built ([`crate::Engine::metrics`]): launches per stage,
/// tokens, requests, latencies, kernel dispatches, and its model family's own counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// The KV pool this engine allocated.
    pub kv_pool: KvPoolStats,
    pub stages: BTreeMap<&'static str, StageStats>,
    /// Tokens handed to requests (eos excluded).
    pub generated_tokens: u64,
    pub finished_requests: u64,
    /// Requests added and not yet admitted, and admitted and not yet finished, as of the last
    /// step or request added or aborted.
    pub waiting_requests: usize,
    pub running_requests: usize,
    /// KV blocks held by running requests (of `kv_pool.blocks`), as of the same moment.
    pub kv_blocks_used: usize,
    /// Requests preempted (their KV freed and recomputed later).
    pub preemptions: u64,
    /// CUDA: the kernel paths this engine's launches dispatched (eager launches and graph
    /// captures).
    pub kernels: crate::ops::KernelCounts,
    /// Per request, from its admission to its first token event.
    pub time_to_first_token: LatencyHistogram,
    /// Between consecutive token events of one request (tokens a diffusion step finalises
    /// together count as arriving together).
    pub inter_token_latency: LatencyHistogram,
    /// What only this engine's model family counts.
    pub family: FamilyMetrics,
}

/// The counters of one model family, beside the common ones of [`EngineMetrics`].
#[derive(Debug, Clone, PartialEq)]
pub enum FamilyMetrics {
    Looped(LoopedMetrics),
    Diffusion(DenoiseStats),
}

impl Default for FamilyMetrics {
    fn default() -> Self {
        Self::Looped(LoopedMetrics::default())
    }
}

impl EngineMetrics {
    /// A looped model's counters (`None` for a diffusion model).
    pub fn looped(&self) -> Option<&LoopedMetrics> {
        match &self.family {
            FamilyMetrics::Looped(m) => Some(m),
            FamilyMetrics::Diffusion(_) => None,
        }
    }
    /// A diffusion model's counters (`None` for a looped model).
    pub fn denoise(&self) -> Option<&DenoiseStats> {
        match &self.family {
            FamilyMetrics::Diffusion(d) => Some(d),
            FamilyMetrics::Looped(_) => None,
        }
    }
}

impl EngineMetrics {
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
