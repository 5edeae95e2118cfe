//! What the engine core needs of a model family: schedule a launch, issue it, wait for its
//! results, hand them to the scheduler and get the new tokens back. The core
//! (`engine/core.rs`) is written once over [`Half`]; the looped and diffusion halves implement
//! it with their own scheduler trait, launch types and runner.

use super::core::Live;
use super::runner::Pending;
use super::{DiffusionRunner, EngineMetrics, LoopedRunner};
use crate::error::InvalidRequest;
use crate::request::{GenerationParams, RequestId};
use crate::sampling::RowSampling;
use crate::scheduler::{DenoiseLaunch, DenoiseResult, DiffusionScheduler, LoopedLaunch, LoopedResult, LoopedScheduler, Scheduler};
use std::collections::HashMap;
use std::time::Duration;

/// A token a launch produced for a request: the id, its log-probability when it was forced, and
/// the compute it took (loop steps run, or the denoising step that revealed it).
pub(super) type NewToken = (RequestId, u32, Option<f32>, Option<u32>);

/// A launch issued to the device whose results have not been consumed yet.
pub(super) struct Issued<L, P> {
    pub launch: L,
    pub pending: P,
    /// Host time spent building and enqueueing it.
    pub host: Duration,
}

/// One model family as the engine core drives it.
pub(super) trait Half {
    type Launch;
    /// An issued launch's results, still on their way or already on the host.
    type Pending;
    type Result;

    fn scheduler(&self) -> &dyn Scheduler;
    fn scheduler_mut(&mut self) -> &mut dyn Scheduler;
    /// Family-specific refusals of a request's parameters.
    fn validate(&self, _params: &GenerationParams) -> Result<(), InvalidRequest> {
        Ok(())
    }
    fn schedule(&mut self) -> Option<Self::Launch>;
    /// Requests with a row in `launch` (each once, in row order).
    fn requests(launch: &Self::Launch) -> Vec<RequestId>;
    /// Metrics key, rows and tokens of `launch`.
    fn shape(launch: &Self::Launch) -> (&'static str, usize, usize);
    /// What `launch` reads and computes, where the family counts it.
    fn cost(&self, _launch: &Self::Launch) -> Option<super::LaunchCost> {
        None
    }
    /// Queues `launch` on the device; `live` gives each sampling row its request's sampler.
    fn issue(&mut self, launch: &Self::Launch, live: &mut HashMap<RequestId, Live>) -> candle_core::Result<Self::Pending>;
    /// Waits for an issued launch's results.
    fn collect(&mut self, pending: Self::Pending) -> candle_core::Result<Self::Result>;
    /// Hands the results to the scheduler, records the family's metrics and returns the tokens
    /// that became final, in order per request.
    fn complete(&mut self, launch: &Self::Launch, result: Self::Result, metrics: &mut EngineMetrics) -> Vec<NewToken>;
    /// With overlap on, parks `next` and returns the launch issued before it; otherwise returns
    /// `next` itself.
    fn swap_in_flight(&mut self, next: Option<Issued<Self::Launch, Self::Pending>>) -> Option<Issued<Self::Launch, Self::Pending>> {
        next
    }
    fn has_in_flight(&self) -> bool {
        false
    }
}

/// A looped model: its runner, scheduler, and the launch in flight under overlap.
pub(super) struct LoopedHalf {
    pub runner: LoopedRunner,
    pub scheduler: Box<dyn LoopedScheduler>,
    pub overlap: bool,
    pub in_flight: Option<Issued<LoopedLaunch, Pending>>,
}

impl Half for LoopedHalf {
    type Launch = LoopedLaunch;
    type Pending = Pending;
    type Result = LoopedResult;

    fn scheduler(&self) -> &dyn Scheduler {
        self.scheduler.as_ref()
    }
    fn scheduler_mut(&mut self) -> &mut dyn Scheduler {
        self.scheduler.as_mut()
    }
    fn schedule(&mut self) -> Option<LoopedLaunch> {
        self.scheduler.schedule()
    }
    fn requests(launch: &LoopedLaunch) -> Vec<RequestId> {
        launch.rows.iter().map(|r| r.request).collect()
    }
    fn shape(launch: &LoopedLaunch) -> (&'static str, usize, usize) {
        (launch.stage.name(), launch.rows.len(), launch.num_tokens())
    }
    fn cost(&self, launch: &LoopedLaunch) -> Option<super::LaunchCost> {
        Some(super::looped_launch_cost(self.runner.model().spec(), launch))
    }

    fn issue(&mut self, launch: &LoopedLaunch, live: &mut HashMap<RequestId, Live>) -> candle_core::Result<Pending> {
        let sampling: Vec<RowSampling> = launch
            .rows
            .iter()
            .map(|r| match (r.sample, live.get_mut(&r.request)) {
                (true, Some(l)) => l.next_sampling_row(),
                _ => RowSampling::greedy(),
            })
            .collect();
        self.runner.launch(launch, &sampling)
    }

    fn collect(&mut self, pending: Pending) -> candle_core::Result<LoopedResult> {
        self.runner.collect(pending)
    }

    fn complete(&mut self, launch: &LoopedLaunch, result: LoopedResult, metrics: &mut EngineMetrics) -> Vec<NewToken> {
        if let Some(span) = self.runner.last_device_time() {
            metrics.record_device(launch.stage.name(), span);
        }
        self.scheduler.complete(launch, &result);
        (metrics.graph_captures, metrics.graph_replays) = self.runner.graph_stats();
        // A coda row's token ran its item's loop steps (the row's step is the last one run); a
        // full-depth launch runs every step it lists.
        let steps = |row: &crate::scheduler::LoopedRow| match launch.stage {
            crate::scheduler::Stage::Coda => Some(row.step as u32 + 1),
            crate::scheduler::Stage::Prefill | crate::scheduler::Stage::FullDepthDecode => Some(launch.step_slots.len() as u32),
            crate::scheduler::Stage::CoreStep => None,
        };
        launch.rows.iter().zip(&result.rows).filter_map(|(row, out)| out.token.map(|t| (out.request, t, out.logprob, steps(row)))).collect()
    }

    fn swap_in_flight(&mut self, next: Option<Issued<LoopedLaunch, Pending>>) -> Option<Issued<LoopedLaunch, Pending>> {
        if self.overlap {
            std::mem::replace(&mut self.in_flight, next)
        } else {
            next
        }
    }
    fn has_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }
}

/// A diffusion model: its runner and scheduler. Launches run to completion when issued (the
/// next step's rows depend on this step's reveals).
pub(super) struct DiffusionHalf {
    pub runner: DiffusionRunner,
    pub scheduler: Box<dyn DiffusionScheduler>,
}

impl Half for DiffusionHalf {
    type Launch = DenoiseLaunch;
    type Pending = DenoiseResult;
    type Result = DenoiseResult;

    fn scheduler(&self) -> &dyn Scheduler {
        self.scheduler.as_ref()
    }
    fn scheduler_mut(&mut self) -> &mut dyn Scheduler {
        self.scheduler.as_mut()
    }
    /// Decoding is greedy: a step reveals the argmax tokens by confidence.
    fn validate(&self, params: &GenerationParams) -> Result<(), InvalidRequest> {
        if !params.sampling.is_greedy() {
            return Err(InvalidRequest::BadSampling("diffusion models decode greedily (temperature 0)".into()));
        }
        if !params.forced_tokens.is_empty() {
            return Err(InvalidRequest::BadSampling("teacher forcing is not supported for diffusion models".into()));
        }
        Ok(())
    }
    fn schedule(&mut self) -> Option<DenoiseLaunch> {
        self.scheduler.schedule()
    }
    fn requests(launch: &DenoiseLaunch) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = launch.rows.iter().map(|r| r.request).collect();
        ids.dedup();
        ids
    }
    fn shape(launch: &DenoiseLaunch) -> (&'static str, usize, usize) {
        ("denoise", launch.rows.len(), launch.num_tokens())
    }
    fn issue(&mut self, launch: &DenoiseLaunch, _live: &mut HashMap<RequestId, Live>) -> candle_core::Result<DenoiseResult> {
        self.runner.run(launch)
    }
    fn collect(&mut self, result: DenoiseResult) -> candle_core::Result<DenoiseResult> {
        Ok(result)
    }

    fn complete(&mut self, launch: &DenoiseLaunch, mut result: DenoiseResult, metrics: &mut EngineMetrics) -> Vec<NewToken> {
        metrics.record_denoise(launch, &result);
        metrics.denoise.phases = self.runner.phase_times();
        // A readout's confidence 1 / Σ exp(l − max) is not finite exactly when its logits hold a
        // NaN or an infinity (a −∞ only at the masked-out mask token leaves it finite). Such a
        // row reveals nothing; its request gets the non-finite flag and ends with an error.
        let vocab = self.runner.model().spec().vocab_size as u32;
        let mut failed = Vec::new();
        for out in &mut result.rows {
            if out.candidates.iter().any(|&(_, c)| !c.is_finite()) {
                out.candidates.clear();
                failed.push((out.request, vocab, None, None));
            }
        }
        let emitted = self.scheduler.complete(launch, &result);
        let mut tokens: Vec<NewToken> = emitted
            .into_iter()
            .flat_map(|e| {
                let steps = e.steps;
                e.tokens.into_iter().enumerate().map(move |(i, t)| (e.request, t, None, steps.get(i).copied()))
            })
            .collect();
        tokens.extend(failed);
        tokens
    }
}
