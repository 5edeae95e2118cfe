//! The engine loop: validate requests, ask the scheduler for a launch, run it, turn sampled
//! tokens into events, tell the scheduler who finished.

use super::detok::{Detokenizer, Pushed};
use super::runner::Pending;
use super::{DiffusionRunner, EngineMetrics, Event, FinishReason, GenerationParams, LoopedRunner, Output, Prompt, RequestId};
use crate::error::InvalidRequest;
use crate::models::diffusion::DiffusionSpec;
use crate::models::LoopedSpec;
use crate::sampling::{RowSampling, Sampler};
use crate::scheduler::{Launch, LaunchResult, SchedRequest, Scheduler};
use crate::{Error, Result};
use std::collections::HashMap;
use std::time::Instant;
use tokenizers::Tokenizer;

/// What runs launches: a looped model's stages or a diffusion model's denoise steps.
pub(super) enum ModelRunner {
    Looped(LoopedRunner),
    Diffusion(DiffusionRunner),
}

/// Results of an issued launch: still on their way (looped launches read back asynchronously)
/// or already on the host.
enum InFlight {
    Looped(Pending),
    Ready(LaunchResult),
}

/// A launch issued to the device whose results have not been consumed yet.
struct Issued {
    launch: Launch,
    pending: InFlight,
    /// Host time spent building and enqueueing it.
    host: std::time::Duration,
}

struct Live {
    params: GenerationParams,
    /// Sampling rows issued so far (the next forced token's index; may run ahead of
    /// `generated` when launches overlap).
    issued: usize,
    sampler: Sampler,
    generated: Vec<u32>,
    detok: Detokenizer,
}

/// A serving engine for one model. Single-threaded: drive it with [`Engine::step`], or move
/// it to its own thread with [`crate::EngineBuilder::spawn`].
pub struct Engine {
    pub(super) runner: ModelRunner,
    pub(super) scheduler: Box<dyn Scheduler>,
    pub(super) tokenizer: Option<Tokenizer>,
    pub(super) eos: Vec<u32>,
    pub(super) max_context: usize,
    pub(super) max_prefill_tokens: usize,
    live: HashMap<RequestId, Live>,
    pending: Vec<Event>,
    /// Overlap: the launch issued last step, results not yet consumed.
    in_flight: Option<Issued>,
    overlap: bool,
    next_id: u64,
    metrics: EngineMetrics,
}

impl Engine {
    pub(super) fn assemble(
        runner: ModelRunner,
        scheduler: Box<dyn Scheduler>,
        tokenizer: Option<Tokenizer>,
        eos: Vec<u32>,
        max_context: usize,
        max_prefill_tokens: usize,
    ) -> Self {
        Self {
            runner,
            scheduler,
            tokenizer,
            eos,
            max_context,
            max_prefill_tokens,
            live: HashMap::new(),
            pending: Vec::new(),
            in_flight: None,
            overlap: false,
            next_id: 0,
            metrics: EngineMetrics::default(),
        }
    }

    /// The looped model's spec (`None` for a diffusion model).
    pub fn spec(&self) -> Option<&LoopedSpec> {
        match &self.runner {
            ModelRunner::Looped(r) => Some(r.model().spec()),
            ModelRunner::Diffusion(_) => None,
        }
    }
    /// The diffusion model's spec (`None` for a looped model).
    pub fn diffusion_spec(&self) -> Option<&DiffusionSpec> {
        match &self.runner {
            ModelRunner::Diffusion(r) => Some(r.model().spec()),
            ModelRunner::Looped(_) => None,
        }
    }
    pub fn vocab_size(&self) -> usize {
        match &self.runner {
            ModelRunner::Looped(r) => r.model().spec().vocab_size,
            ModelRunner::Diffusion(r) => r.model().spec().vocab_size,
        }
    }
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }
    pub fn scheduler(&self) -> &dyn Scheduler {
        self.scheduler.as_ref()
    }
    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }
    /// Requests added and not yet finished.
    pub fn num_unfinished(&self) -> usize {
        self.live.len()
    }
    pub fn has_work(&self) -> bool {
        !self.live.is_empty() || !self.pending.is_empty() || self.in_flight.is_some()
    }

    /// Issues each launch before consuming the previous one's results (see [`Engine::step`]).
    /// Only for schedulers that support it (depth batching with a gate that decides one step
    /// ahead: lookahead, replay, fixed); others get `Error::InvalidOption`.
    pub fn set_overlap(&mut self, on: bool) -> Result<()> {
        if on && !self.scheduler.supports_overlap() {
            return Err(Error::InvalidOption(format!(
                "scheduler `{}` cannot overlap launches with its gate (it needs each step's signal before the next launch)",
                self.scheduler.name()
            )));
        }
        if !on {
            if let Some(done) = self.in_flight.take() {
                let mut events = std::mem::take(&mut self.pending);
                let r = self.consume(done, &mut events);
                self.pending.extend(events);
                r?;
            }
        }
        self.overlap = on;
        Ok(())
    }

    /// Encodes text with the model's tokenizer.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| Error::Tokenizer("model has no tokenizer.json".into()))?;
        let enc = tok.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Validates and queues a request. A rejected request gets a typed error and leaves no
    /// state behind; the engine and other requests are unaffected.
    pub fn add_request(&mut self, prompt: impl Into<Prompt>, params: GenerationParams) -> Result<RequestId> {
        self.admit(prompt, params).map(|(id, _)| id)
    }

    /// [`Engine::add_request`], also returning the prompt's length in tokens.
    pub(super) fn admit(&mut self, prompt: impl Into<Prompt>, params: GenerationParams) -> Result<(RequestId, usize)> {
        // Encoded first: a text the tokenizer refuses (`Error::Tokenizer`, no request) uses no id.
        let ids = match prompt.into() {
            Prompt::Ids(ids) => ids,
            Prompt::Text(t) => self.encode(&t)?,
        };
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let reject = |reason| Err(Error::InvalidRequest { id, reason });
        if ids.is_empty() {
            return reject(InvalidRequest::EmptyPrompt);
        }
        let vocab = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return reject(InvalidRequest::UnknownToken { token: bad, vocab_size: vocab });
        }
        if let Err(msg) = params.sampling.validate() {
            return reject(InvalidRequest::BadSampling(msg));
        }
        if let Some(&bad) = params.forced_tokens.iter().find(|&&t| t as usize >= vocab) {
            return reject(InvalidRequest::UnknownToken { token: bad, vocab_size: vocab });
        }
        if let ModelRunner::Diffusion(_) = self.runner {
            // Diffusion decoding here is greedy: a step reveals the argmax tokens by confidence.
            if !params.sampling.is_greedy() {
                return reject(InvalidRequest::BadSampling("diffusion models decode greedily (temperature 0)".into()));
            }
            if !params.forced_tokens.is_empty() {
                return reject(InvalidRequest::BadSampling("teacher forcing is not supported for diffusion models".into()));
            }
        }
        let too_long = InvalidRequest::TooLong { prompt_tokens: ids.len(), max_new_tokens: params.max_new_tokens, max_context: self.max_context };
        // Checked first, so that no scheduler sums a length that overflows.
        if ids.len().checked_add(params.max_new_tokens).is_none_or(|n| n > self.max_context) {
            return reject(too_long);
        }
        let positions = self.scheduler.kv_positions(ids.len(), params.max_new_tokens);
        if positions > self.max_context {
            return reject(too_long);
        }
        let prefill = self.scheduler.max_prefill_tokens(ids.len(), params.max_new_tokens);
        if prefill > self.max_prefill_tokens {
            return reject(InvalidRequest::OverTokenBudget { prefill_tokens: prefill, budget: self.max_prefill_tokens });
        }
        let kv = self.scheduler.kv();
        let needed = kv.blocks_for(positions);
        if needed > kv.num_blocks() {
            return Err(Error::KvExhausted { id, needed_blocks: needed, total_blocks: kv.num_blocks() });
        }
        if params.max_new_tokens == 0 {
            self.pending.push(Event::Finished { id, reason: FinishReason::Length, text: String::new() });
            return Ok((id, ids.len()));
        }
        let prompt_tokens = ids.len();
        self.scheduler.add(SchedRequest { id, prompt: ids, max_new_tokens: params.max_new_tokens });
        self.live.insert(id, Live { sampler: Sampler::new(params.sampling.clone()), issued: 0, params, generated: Vec::new(), detok: Detokenizer::default() });
        Ok((id, prompt_tokens))
    }

    /// Stops a request now and frees its KV blocks. Its `Finished { Aborted }` event comes
    /// with the next [`Engine::step`].
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        let mut live = self.retire(id).ok_or(Error::UnknownRequest(id))?;
        self.pending.push(Event::Finished { id, reason: FinishReason::Aborted, text: live.detok.flush() });
        Ok(())
    }

    /// Runs one launch and returns the events it produced. A device error fails every request
    /// of the launch (their `Finished { Error }` events come back) and is returned too.
    ///
    /// With overlap on, the launch scheduled now is issued *before* the previous launch's
    /// results are consumed, so the host builds launch N+1 while the device runs launch N; the
    /// events of a step are those of the previous launch.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = std::mem::take(&mut self.pending);
        let issued = match self.scheduler.schedule() {
            Some(launch) => Some(self.issue(launch, &mut events)?),
            None => None,
        };
        let done = if self.overlap { std::mem::replace(&mut self.in_flight, issued) } else { issued };
        match done {
            Some(done) => self.consume(done, &mut events)?,
            None if events.is_empty() && !self.live.is_empty() && self.in_flight.is_none() => {
                return Err(self.fail_stalled());
            }
            None => {}
        }
        Ok(events)
    }

    /// Runs `launch` on the device (its results are read now or one step later).
    fn issue(&mut self, launch: Launch, events: &mut Vec<Event>) -> Result<Issued> {
        let sampling: Vec<RowSampling> = launch
            .rows
            .iter()
            .map(|r| match (r.sample, self.live.get_mut(&r.request)) {
                (true, Some(l)) => {
                    let mut row = l.sampler.next_row();
                    row.forced = l.params.forced_tokens.get(l.issued).copied();
                    l.issued += 1;
                    row
                }
                _ => RowSampling::greedy(),
            })
            .collect();
        let started = Instant::now();
        let pending = match &self.runner {
            ModelRunner::Looped(r) => r.launch(&launch, &sampling).map(InFlight::Looped),
            ModelRunner::Diffusion(r) => r.run(&launch).map(InFlight::Ready),
        };
        match pending {
            Ok(pending) => Ok(Issued { launch, pending, host: started.elapsed() }),
            Err(e) => Err(self.fail_launch(&launch, e, events)),
        }
    }

    /// A device error fails every request of the launch; the error is returned too.
    fn fail_launch(&mut self, launch: &Launch, e: candle_core::Error, events: &mut Vec<Event>) -> Error {
        let msg = e.to_string();
        for row in &launch.rows {
            if self.retire(row.request).is_some() {
                events.push(Event::Finished { id: row.request, reason: FinishReason::Error(msg.clone()), text: String::new() });
            }
        }
        self.pending = std::mem::take(events);
        e.into()
    }

    /// Ends a live request's life in the engine: out of `live`, its scheduler state and KV freed.
    fn retire(&mut self, id: RequestId) -> Option<Live> {
        let live = self.live.remove(&id)?;
        self.scheduler.finish(id);
        Some(live)
    }

    /// The scheduler has live requests but nothing to launch and nothing in flight: no later
    /// step would change that, so every live request fails (its KV is freed, its
    /// `Finished { Error }` event comes with the next step) and the error is returned.
    fn fail_stalled(&mut self) -> Error {
        let err = Error::SchedulerStalled { scheduler: self.scheduler.name().into(), unfinished: self.live.len() };
        let msg = err.to_string();
        let mut ids: Vec<RequestId> = self.live.keys().copied().collect();
        ids.sort_by_key(|id| id.0);
        for id in ids {
            let mut live = self.retire(id).expect("listed");
            self.pending.push(Event::Finished { id, reason: FinishReason::Error(msg.clone()), text: live.detok.flush() });
        }
        err
    }

    /// Waits for a launch's results, hands them to the scheduler and turns its tokens into
    /// events.
    fn consume(&mut self, done: Issued, events: &mut Vec<Event>) -> Result<()> {
        let started = Instant::now();
        let collected = match (&self.runner, done.pending) {
            (ModelRunner::Looped(r), InFlight::Looped(p)) => r.collect(p),
            (_, InFlight::Ready(result)) => Ok(result),
            (ModelRunner::Diffusion(_), InFlight::Looped(_)) => {
                unreachable!("diffusion launches complete when issued")
            }
        };
        let result = match collected {
            Ok(r) => r,
            Err(e) => return Err(self.fail_launch(&done.launch, e, events)),
        };
        let wait = started.elapsed();
        let l = &done.launch;
        self.metrics.record(l.stage.name(), l.rows.len(), l.num_tokens(), done.host + wait, wait);
        if let ModelRunner::Looped(r) = &self.runner {
            if let Some(span) = r.last_device_time() {
                self.metrics.record_device(l.stage.name(), span);
            }
        }
        self.scheduler.complete(&done.launch, &result);
        for out in &result.rows {
            if let Some(token) = out.token {
                if let Some(ev) = self.on_token(out.request, token, out.logprob) {
                    events.extend(ev);
                }
            }
        }
        // Diffusion schedulers decide final tokens themselves (the unmask policy).
        for (id, tokens) in self.scheduler.take_emitted() {
            for token in tokens {
                match self.on_token(id, token, None) {
                    Some(ev) => events.extend(ev),
                    None => break, // finished (eos, stop, length) or aborted
                }
            }
        }
        if l.stage == crate::scheduler::Stage::Denoise {
            self.metrics.record_denoise(l, &result);
            if let ModelRunner::Diffusion(r) = &self.runner {
                self.metrics.denoise.phases = r.phase_times();
            }
            if let Some((revealed, kept)) = self.scheduler.revealed_in_kept() {
                (self.metrics.denoise.revealed, self.metrics.denoise.revealed_kept) = (revealed, kept);
            }
        }
        self.metrics.preemptions = self.scheduler.num_preemptions() as u64;
        self.metrics.depth_histogram = self.scheduler.depth_histogram();
        Ok(())
    }

    fn on_token(&mut self, id: RequestId, token: u32, logprob: Option<f32>) -> Option<Vec<Event>> {
        let live = self.live.get_mut(&id)?;
        let mut events = Vec::with_capacity(2);
        let finish = if !live.params.ignore_eos && self.eos.contains(&token) {
            Some(FinishReason::Eos)
        } else {
            live.generated.push(token);
            self.metrics.generated_tokens += 1;
            match live.detok.push(token, self.tokenizer.as_ref(), &live.params.stop) {
                Pushed::Text(text) => {
                    events.push(Event::Token { id, token, text, logprob });
                    (live.generated.len() >= live.params.max_new_tokens).then_some(FinishReason::Length)
                }
                Pushed::Stopped { text, stop } => {
                    events.push(Event::Token { id, token, text, logprob });
                    Some(FinishReason::Stop(stop))
                }
            }
        };
        if let Some(reason) = finish {
            let mut live = self.retire(id).expect("present");
            self.metrics.finished_requests += 1;
            events.push(Event::Finished { id, reason, text: live.detok.flush() });
        }
        Some(events)
    }

    /// Runs prompts to completion and returns their outputs in order. Each prompt that is
    /// rejected gets its error in its place; the others still run. A request failed by the
    /// device or a stalled scheduler ends with `FinishReason::Error` in its output.
    pub fn generate<P: Into<Prompt>>(&mut self, prompts: impl IntoIterator<Item = P>, params: &GenerationParams) -> Result<Vec<Result<Output>>> {
        let mut slots: Vec<Result<Output>> = Vec::new();
        let mut index = HashMap::new();
        for p in prompts {
            match self.admit(p, params.clone()) {
                Ok((id, prompt_tokens)) => {
                    index.insert(id, slots.len());
                    slots.push(Ok(Output::new(id, prompt_tokens)));
                }
                Err(e) => slots.push(Err(e)),
            }
        }
        let mut open = index.len();
        while open > 0 {
            // A failed launch or a stalled scheduler fails its requests, whose
            // `Finished { Error }` events come with the next step; the others go on.
            let events = match self.step() {
                Ok(events) => events,
                Err(_) if !self.pending.is_empty() => continue,
                Err(e) => return Err(e),
            };
            if events.is_empty() && !self.has_work() {
                break;
            }
            for ev in events {
                let Some(&i) = index.get(&ev.id()) else {
                    continue;
                };
                let Ok(out) = &mut slots[i] else { continue };
                if out.push(ev) {
                    open -= 1;
                }
            }
        }
        Ok(slots)
    }
}
