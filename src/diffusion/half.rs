//! The diffusion family as the engine core drives it ([`Half`]).

use super::executor::DiffusionExecutor;
use super::launch::{DenoiseLaunch, DenoiseResult, DiffusionScheduler};
use super::StepDraw;
use crate::engine::{Completed, EngineMetrics, FamilyMetrics, Half, Live};
use crate::error::InvalidRequest;
use crate::request::{GenerationParams, RequestId, TokenCompute};
use crate::scheduler::Requests;
use std::collections::HashMap;

/// A diffusion model: its runner and scheduler. Launches run to completion when issued (the
/// next step's rows depend on this step's reveals).
pub(crate) struct DiffusionHalf {
    pub runner: DiffusionExecutor,
    pub scheduler: Box<dyn DiffusionScheduler>,
}

impl Half for DiffusionHalf {
    type Launch = DenoiseLaunch;
    type Pending = DenoiseResult;
    type Result = DenoiseResult;

    fn scheduler_name(&self) -> &'static str {
        self.scheduler.name()
    }
    fn finished(&mut self, id: RequestId) {
        self.scheduler.finished(id);
    }
    fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        self.scheduler.kv_positions(prompt_len, max_new_tokens)
    }
    /// Temperature 0 (or top-k 1) reveals the argmax tokens by confidence; otherwise a step
    /// draws its tokens as the family's sampler does ([`crate::diffusion::DiffusionSampler`]).
    fn validate(&self, params: &GenerationParams) -> Result<(), InvalidRequest> {
        if params.logprobs.is_some() {
            // A revealed token's probability is conditioned on a partly masked canvas and taken
            // at whichever step revealed it: not the sequence model's log-probability.
            return Err(InvalidRequest::Logprobs("not reported for diffusion models".into()));
        }
        if !params.forced_tokens.is_empty() {
            return Err(InvalidRequest::BadSampling("teacher forcing is not supported for diffusion models".into()));
        }
        Ok(())
    }
    fn schedule(&mut self, requests: &mut Requests) -> Option<DenoiseLaunch> {
        self.scheduler.schedule(requests)
    }
    fn launch_requests(launch: &DenoiseLaunch) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = launch.rows.iter().map(|r| r.request).collect();
        ids.dedup();
        ids
    }
    fn shape(launch: &DenoiseLaunch) -> (&'static str, usize, usize) {
        ("denoise", launch.rows.len(), launch.num_tokens())
    }
    fn issue(&mut self, launch: &DenoiseLaunch, live: &mut HashMap<RequestId, Live>) -> crate::Result<DenoiseResult> {
        // A step row (one with readouts) of a sampling request takes that request's next draws.
        let draws: Vec<Option<StepDraw>> =
            launch.rows.iter().map(|r| if r.readout.is_empty() { None } else { live.get_mut(&r.request).and_then(Live::next_step_draw) }).collect();
        self.runner.run(launch, &draws)
    }
    fn collect(&mut self, result: DenoiseResult) -> crate::Result<DenoiseResult> {
        Ok(result)
    }

    fn complete(&mut self, requests: &mut Requests, launch: &DenoiseLaunch, mut result: DenoiseResult, metrics: &mut EngineMetrics) -> Completed {
        // A readout's confidence 1 / Σ exp(l − max) is not finite exactly when its logits hold a
        // NaN or an infinity (a −∞ only at the masked-out mask token leaves it finite). Such a
        // row reveals nothing, and its request is the launch's typed non-finite outcome.
        for out in &mut result.rows {
            if out.candidates.iter().any(|&(_, c)| !c.is_finite()) {
                out.candidates.clear();
                if !result.non_finite.contains(&out.request) {
                    result.non_finite.push(out.request);
                }
            }
        }
        if let FamilyMetrics::Diffusion(d) = &mut metrics.family {
            d.record(launch, &result);
            d.phases = self.runner.phase_times();
        }
        let emitted = self.scheduler.complete(requests, launch, &result);
        if let (FamilyMetrics::Diffusion(d), Some((revealed, kept))) = (&mut metrics.family, self.scheduler.revealed_in_kept()) {
            (d.revealed, d.revealed_kept) = (revealed, kept);
        }
        let tokens = emitted
            .into_iter()
            .flat_map(|e| {
                let steps = e.steps;
                e.tokens.into_iter().enumerate().map(move |(i, t)| (e.request, t, None, steps.get(i).map(|&s| TokenCompute::DenoiseStep(s))))
            })
            .collect();
        Completed { tokens, non_finite: result.non_finite }
    }
}
