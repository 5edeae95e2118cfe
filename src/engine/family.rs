//! What the engine core needs of a model family: schedule a launch, issue it, wait for its
//! results, hand them to the scheduler and get the new tokens back. The core
//! (`engine/core.rs`) is written once over [`Half`]; the looped and diffusion halves
//! (`looped/half.rs`, `diffusion/half.rs`) implement it with their own scheduler trait, launch
//! types and runner.

use super::live::Live;
use super::{EngineMetrics, LaunchCost};
use crate::error::InvalidRequest;
use crate::request::{GenerationParams, RequestId, TokenCompute};
use crate::scheduler::Requests;
use std::collections::HashMap;
use std::time::Duration;

/// A token a launch produced for a request: the id, its log-probability when it was forced, and
/// the compute it took.
pub(crate) type NewToken = (RequestId, u32, Option<crate::TokenLogprob>, Option<TokenCompute>);

/// What a completed launch gave the core: the tokens that became final, in order per request,
/// and the requests whose logits were not finite (they end with an error).
#[derive(Default)]
pub(crate) struct Completed {
    pub tokens: Vec<NewToken>,
    pub non_finite: Vec<RequestId>,
}

/// A launch issued to the device whose results have not been consumed yet.
pub(crate) struct Issued<L, P> {
    pub launch: L,
    pub pending: P,
    /// Host time spent building and enqueueing it.
    pub host: Duration,
}

/// One model family as the engine core drives it.
pub(crate) trait Half {
    type Launch;
    /// An issued launch's results, still on their way or already on the host.
    type Pending;
    type Result;

    fn scheduler_name(&self) -> &'static str;
    /// Tells the scheduler a request ended (the core has freed its blocks).
    fn finished(&mut self, id: RequestId);
    /// Family-specific refusals of a request's parameters.
    fn validate(&self, _params: &GenerationParams) -> Result<(), InvalidRequest> {
        Ok(())
    }
    /// Cache positions a request of `prompt_len` prompt tokens and `max_new_tokens` needs at
    /// most.
    fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        prompt_len + max_new_tokens
    }
    fn schedule(&mut self, requests: &mut Requests) -> Option<Self::Launch>;
    /// Requests with a row in `launch` (each once, in row order).
    fn launch_requests(launch: &Self::Launch) -> Vec<RequestId>;
    /// Metrics key, rows and tokens of `launch`.
    fn shape(launch: &Self::Launch) -> (&'static str, usize, usize);
    /// What `launch` reads and computes, where the family counts it.
    fn cost(&self, _launch: &Self::Launch) -> Option<LaunchCost> {
        None
    }
    /// Queues `launch` on the device; `live` gives each sampling row its request's sampler.
    fn issue(&mut self, launch: &Self::Launch, live: &mut HashMap<RequestId, Live>) -> crate::Result<Self::Pending>;
    /// Waits for an issued launch's results.
    fn collect(&mut self, pending: Self::Pending) -> crate::Result<Self::Result>;
    /// Hands the results to the scheduler and records the family's metrics.
    fn complete(&mut self, requests: &mut Requests, launch: &Self::Launch, result: Self::Result, metrics: &mut EngineMetrics) -> Completed;
    /// Turns overlap on, or says why the family or its scheduler cannot.
    fn start_overlap(&mut self) -> crate::Result<()> {
        Err(crate::Error::InvalidOption("this model family's launches cannot overlap: each launch's rows depend on the previous one's results".into()))
    }
    /// Turns overlap off and hands back the launch still in flight, for the core to consume.
    fn stop_overlap(&mut self) -> Option<Issued<Self::Launch, Self::Pending>> {
        None
    }
    /// With overlap on, parks `next` and returns the launch issued before it; otherwise returns
    /// `next` itself.
    fn swap_in_flight(&mut self, next: Option<Issued<Self::Launch, Self::Pending>>) -> Option<Issued<Self::Launch, Self::Pending>> {
        next
    }
    fn has_in_flight(&self) -> bool {
        false
    }
}
