//! The diffusion family as the engine core drives it ([`Half`]).

use super::launch::{DenoiseLaunch, DenoiseResult, DiffusionScheduler};
use super::runner::DiffusionRunner;
use crate::engine::{EngineMetrics, Half, Live, NewToken};
use crate::error::InvalidRequest;
use crate::request::{GenerationParams, RequestId};
use crate::scheduler::Scheduler;
use std::collections::HashMap;

/// A diffusion model: its runner and scheduler. Launches run to completion when issued (the
/// next step's rows depend on this step's reveals).
pub(crate) struct DiffusionHalf {
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
