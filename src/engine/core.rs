//! The engine loop, written once over both model families: validate requests, ask the
//! scheduler for a launch, run it, turn new tokens into events, tell the scheduler who
//! finished. What differs between the families sits behind [`Half`].

use super::detok::{Detokenizer, Pushed};
use super::family::{Completed, Half, Issued, NewToken};
use super::live::Live;
use super::metrics::FamilyMetrics;
use super::{EngineMetrics, Event, FinishReason, GenerationParams, Output, Prompt, RequestId};
use crate::chat::{Chat, ChatTemplate};
use crate::diffusion::models::DiffusionSpec;
use crate::diffusion::DiffusionHalf;
use crate::error::InvalidRequest;
use crate::looped::models::LoopedSpec;
use crate::looped::LoopedHalf;
use crate::sampling::Sampler;
use crate::scheduler::{Requests, SchedRequest};
use crate::{Error, Result};
use std::collections::HashMap;
use std::time::Instant;
use tokenizers::Tokenizer;

/// The model family an engine serves, each with its own runner and scheduler trait.
pub(crate) enum Family {
    Looped(Box<LoopedHalf>),
    Diffusion(Box<DiffusionHalf>),
}

/// Calls `$body` with `$h` bound to the family's [`Half`]: the one place the engine branches
/// on the family.
macro_rules! with_half {
    ($family:expr, $h:ident => $body:expr) => {
        match $family {
            Family::Looped($h) => $body,
            Family::Diffusion($h) => $body,
        }
    };
}

/// Request bookkeeping shared by both families: live requests, the scheduler's requests and
/// their KV, pending events, metrics.
struct Core {
    tokenizer: Option<Tokenizer>,
    chat: Option<ChatTemplate>,
    eos: Vec<u32>,
    max_context: usize,
    vocab_size: usize,
    live: HashMap<RequestId, Live>,
    /// Waiting and running requests and their KV blocks, lent to the scheduler.
    requests: Requests,
    pending: Vec<Event>,
    next_id: u64,
    metrics: EngineMetrics,
}

/// An engine's model spec, in its family's terms ([`Engine::spec`]).
#[derive(Debug, Clone, Copy)]
pub enum ModelSpec<'a> {
    Looped(&'a LoopedSpec),
    Diffusion(&'a DiffusionSpec),
}

impl<'a> ModelSpec<'a> {
    /// The looped model's spec (`None` for a diffusion model).
    pub fn looped(self) -> Option<&'a LoopedSpec> {
        match self {
            Self::Looped(s) => Some(s),
            Self::Diffusion(_) => None,
        }
    }
    /// The diffusion model's spec (`None` for a looped model).
    pub fn diffusion(self) -> Option<&'a DiffusionSpec> {
        match self {
            Self::Diffusion(s) => Some(s),
            Self::Looped(_) => None,
        }
    }
}

/// An engine's model spec, owned: what [`crate::EngineHandle::model`] keeps for its callers.
#[derive(Debug, Clone, PartialEq)]
pub enum OwnedModelSpec {
    Looped(LoopedSpec),
    Diffusion(DiffusionSpec),
}

/// What an engine serves, as its users size requests by it: the model's spec, its vocabulary
/// and the longest prompt + output the engine accepts (the model's context, capped by
/// `max_model_len`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub spec: OwnedModelSpec,
    pub vocab_size: usize,
    pub max_context: usize,
}

impl ModelInfo {
    /// The looped model's spec (`None` for a diffusion model).
    pub fn looped(&self) -> Option<&LoopedSpec> {
        match &self.spec {
            OwnedModelSpec::Looped(s) => Some(s),
            OwnedModelSpec::Diffusion(_) => None,
        }
    }
    /// The diffusion model's spec (`None` for a looped model).
    pub fn diffusion(&self) -> Option<&DiffusionSpec> {
        match &self.spec {
            OwnedModelSpec::Diffusion(s) => Some(s),
            OwnedModelSpec::Looped(_) => None,
        }
    }
}

/// A serving engine for one model. Single-threaded: drive it with [`Engine::step`], or move
/// it to its own thread with [`crate::EngineBuilder::spawn`].
pub struct Engine {
    core: Core,
    pub(super) family: Family,
    /// Put in force around every launch this engine runs (`ops::policy`).
    kernels: crate::ops::KernelPolicy,
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assemble(
        family: Family,
        requests: Requests,
        tokenizer: Option<Tokenizer>,
        eos: Vec<u32>,
        chat: Option<ChatTemplate>,
        max_context: usize,
        kv_pool: super::metrics::KvPoolStats,
        kernels: crate::ops::KernelPolicy,
    ) -> Self {
        let (vocab_size, family_metrics) = match &family {
            Family::Looped(h) => (h.runner.spec().vocab_size, FamilyMetrics::Looped(Default::default())),
            Family::Diffusion(h) => (h.runner.spec().vocab_size, FamilyMetrics::Diffusion(Default::default())),
        };
        let core = Core {
            tokenizer,
            chat,
            eos,
            max_context,
            vocab_size,
            live: HashMap::new(),
            requests,
            pending: Vec::new(),
            next_id: 0,
            metrics: EngineMetrics { kv_pool, family: family_metrics, ..EngineMetrics::default() },
        };
        Self { core, family, kernels }
    }

    /// The model's spec, in its family's terms.
    pub fn spec(&self) -> ModelSpec<'_> {
        match &self.family {
            Family::Looped(h) => ModelSpec::Looped(h.runner.spec()),
            Family::Diffusion(h) => ModelSpec::Diffusion(h.runner.spec()),
        }
    }
    pub fn vocab_size(&self) -> usize {
        self.core.vocab_size
    }
    /// The model's spec, vocabulary and accepted context, owned.
    pub fn model_info(&self) -> ModelInfo {
        let spec = match self.spec() {
            ModelSpec::Looped(s) => OwnedModelSpec::Looped(s.clone()),
            ModelSpec::Diffusion(s) => OwnedModelSpec::Diffusion(s.clone()),
        };
        ModelInfo { spec, vocab_size: self.core.vocab_size, max_context: self.core.max_context }
    }
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.core.tokenizer.as_ref()
    }
    /// The scheduler's name (`cb`, `cdb-refill`, `diffusion`, or a custom scheduler's).
    pub fn scheduler_name(&self) -> &'static str {
        with_half!(&self.family, h => h.scheduler_name())
    }
    /// The requests the engine holds for its scheduler: waiting, running and their KV blocks.
    pub fn requests(&self) -> &Requests {
        &self.core.requests
    }
    pub fn metrics(&self) -> &EngineMetrics {
        &self.core.metrics
    }
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.core.eos
    }
    /// Requests added and not yet finished.
    pub fn num_unfinished(&self) -> usize {
        self.core.live.len()
    }
    pub fn has_work(&self) -> bool {
        let in_flight = with_half!(&self.family, h => h.has_in_flight());
        !self.core.live.is_empty() || !self.core.pending.is_empty() || in_flight
    }

    /// Issues each launch before consuming the previous one's results (see [`Engine::step`]),
    /// where the model family and its scheduler allow it (looped models under depth batching
    /// with a gate that decides one step ahead: lookahead, learned lookahead, preloop, replay,
    /// fixed); otherwise `Error::InvalidOption`. Turning it off first consumes the launch in
    /// flight (its events come with the next step).
    pub fn set_overlap(&mut self, on: bool) -> Result<()> {
        with_half!(&mut self.family, h => self.core.set_overlap(&mut **h, on))
    }

    /// Encodes text with the model's tokenizer.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.core.encode(text)
    }

    /// The prompt text a conversation becomes under the model's chat template.
    pub fn render_chat(&self, chat: &Chat) -> Result<String> {
        self.core.render_chat(chat)
    }

    /// Whether [`Prompt::Chat`] prompts can be rendered (the model has a chat template).
    pub fn has_chat_template(&self) -> bool {
        self.core.chat.is_some()
    }

    /// The chat template itself, for a handle that renders on its callers' threads.
    pub(super) fn chat_template(&self) -> Option<&ChatTemplate> {
        self.core.chat.as_ref()
    }

    /// Validates and queues a request. A rejected request gets a typed error and leaves no
    /// state behind; the engine and other requests are unaffected.
    pub fn add_request(&mut self, prompt: impl Into<Prompt>, params: GenerationParams) -> Result<RequestId> {
        self.admit(prompt, params).map(|(id, _)| id)
    }

    /// [`Engine::add_request`], also returning the prompt's length in tokens.
    pub(super) fn admit(&mut self, prompt: impl Into<Prompt>, params: GenerationParams) -> Result<(RequestId, usize)> {
        let prompt = prompt.into();
        let r = with_half!(&mut self.family, h => self.core.admit(&mut **h, prompt, params));
        self.core.count_requests();
        r
    }

    /// Stops a request now and frees its KV blocks. Its `Finished { Aborted }` event comes
    /// with the next [`Engine::step`]. A request that is no longer running is
    /// [`Error::UnknownRequest`] — also one admitted with `max_new_tokens` = 0, which finishes at
    /// admission (its `Finished { Length }` event comes with the next step all the same).
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        let mut live = with_half!(&mut self.family, h => self.core.retire(&mut **h, id)).ok_or(Error::UnknownRequest(id))?;
        self.core.pending.push(Event::Finished { id, reason: FinishReason::Aborted, text: live.detok.flush() });
        self.core.count_requests();
        Ok(())
    }

    /// Runs one launch and returns the events it produced. A device error fails every request
    /// of the launch (their `Finished { Error }` events come back) and is returned too.
    ///
    /// With overlap on, the launch scheduled now is issued *before* the previous launch's
    /// results are consumed, so the host builds launch N+1 while the device runs launch N; the
    /// events of a step are those of the previous launch.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let (core, family) = (&mut self.core, &mut self.family);
        let (events, counts) = crate::ops::with_kernels(self.kernels, || with_half!(family, h => core.step(&mut **h)));
        self.core.metrics.kernels += counts;
        self.core.count_requests();
        events
    }

    /// The kernel choices this engine's launches run under.
    pub fn kernels(&self) -> crate::ops::KernelPolicy {
        self.kernels
    }

    /// Runs prompts to completion and returns their outputs in order. Each prompt that is
    /// rejected gets its error in its place; the others still run. A request failed by the
    /// device or a stalled scheduler ends with `FinishReason::Error` in its output. Requests
    /// added before (`add_request`) run alongside; their events are kept for the next `step`.
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
        // `index` holds the requests still open; `others`, the events of requests added before,
        // handed back to the caller's next `step` (not left pending meanwhile, so that
        // `has_work` still says whether these prompts can finish).
        let mut others = Vec::new();
        while !index.is_empty() {
            // A failed launch or a stalled scheduler fails its requests, whose
            // `Finished { Error }` events come with the next step; the others go on.
            let events = match self.step() {
                Ok(events) => events,
                Err(_) if !self.core.pending.is_empty() => continue,
                Err(e) => return Err(e),
            };
            if events.is_empty() && !self.has_work() {
                // Nothing left to run yet some requests never finished: say so in their outputs
                // rather than return them as if they had ended normally.
                for &i in index.values() {
                    if let Ok(out) = &mut slots[i] {
                        out.finish_reason = FinishReason::Error("the engine ran out of work before this request finished".into());
                    }
                }
                break;
            }
            for ev in events {
                let id = ev.id();
                let Some(&i) = index.get(&id) else {
                    others.push(ev);
                    continue;
                };
                let Ok(out) = &mut slots[i] else { continue };
                if out.push(ev) {
                    index.remove(&id);
                }
            }
        }
        others.append(&mut self.core.pending);
        self.core.pending = others;
        Ok(slots)
    }
}

impl Core {
    /// The metrics' gauges: requests waiting and running, KV blocks in use.
    fn count_requests(&mut self) {
        let m = &mut self.metrics;
        (m.waiting_requests, m.running_requests, m.kv_blocks_used) =
            (self.requests.num_waiting(), self.requests.num_running(), self.requests.kv().num_used_blocks());
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        encode_text(self.tokenizer.as_ref(), text)
    }

    fn render_chat(&self, chat: &Chat) -> Result<String> {
        render_chat(self.chat.as_ref(), chat)
    }

    fn admit<H: Half>(&mut self, half: &mut H, prompt: Prompt, params: GenerationParams) -> Result<(RequestId, usize)> {
        // Encoded first: a text the tokenizer or the chat template refuses (`Error::Tokenizer`,
        // `Error::ChatTemplate`; no request) uses no id. The template writes the special
        // tokens itself, so the tokenizer adds none (as `apply_chat_template` encodes).
        let ids = prompt_ids(self.tokenizer.as_ref(), self.chat.as_ref(), prompt)?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let reject = |reason| Err(Error::InvalidRequest { id, reason });
        if ids.is_empty() {
            return reject(InvalidRequest::EmptyPrompt);
        }
        let vocab = self.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return reject(InvalidRequest::UnknownToken { token: bad, vocab_size: vocab });
        }
        if let Err(msg) = params.sampling.validate() {
            return reject(InvalidRequest::BadSampling(msg));
        }
        if let Some(n) = params.logprobs.filter(|&n| n > crate::request::MAX_TOP_LOGPROBS) {
            return reject(InvalidRequest::Logprobs(format!("{n} alternatives asked; at most {}", crate::request::MAX_TOP_LOGPROBS)));
        }
        if let Some(&bad) = params.forced_tokens.iter().find(|&&t| t as usize >= vocab) {
            return reject(InvalidRequest::UnknownToken { token: bad, vocab_size: vocab });
        }
        if let Err(reason) = half.validate(&params) {
            return reject(reason);
        }
        let too_long = InvalidRequest::TooLong { prompt_tokens: ids.len(), max_new_tokens: params.max_new_tokens, max_context: self.max_context };
        // Checked first, so that no scheduler sums a length that overflows.
        if ids.len().checked_add(params.max_new_tokens).is_none_or(|n| n > self.max_context) {
            return reject(too_long);
        }
        let positions = half.kv_positions(ids.len(), params.max_new_tokens);
        if positions > self.max_context {
            return reject(too_long);
        }
        let kv = self.requests.kv();
        let needed = kv.blocks_for(positions);
        if needed > kv.num_blocks() {
            return Err(Error::KvExhausted { id, needed_blocks: needed, total_blocks: kv.num_blocks() });
        }
        if params.max_new_tokens == 0 {
            self.pending.push(Event::Finished { id, reason: FinishReason::Length, text: String::new() });
            return Ok((id, ids.len()));
        }
        let prompt_tokens = ids.len();
        self.requests.add(SchedRequest { id, prompt: ids, max_new_tokens: params.max_new_tokens });
        let live = Live {
            sampler: Sampler::new(params.sampling.clone()),
            issued: 0,
            params,
            generated: Vec::new(),
            detok: Detokenizer::default(),
            arrived: Instant::now(),
            last_token: None,
        };
        self.live.insert(id, live);
        tracing::debug!(request = id.0, prompt_tokens, "admitted");
        Ok((id, prompt_tokens))
    }

    fn step<H: Half>(&mut self, half: &mut H) -> Result<Vec<Event>> {
        let mut events = std::mem::take(&mut self.pending);
        // With no request live there is nothing to schedule (and a scheduler that launches
        // anyway must not hold up the events already pending).
        let scheduled = if self.live.is_empty() { None } else { half.schedule(&mut self.requests) };
        let issued = match scheduled {
            Some(launch) => {
                let started = Instant::now();
                match half.issue(&launch, &mut self.live) {
                    Ok(pending) => Some(Issued { launch, pending, host: started.elapsed() }),
                    Err(e) => return Err(self.fail_launch(half, &H::launch_requests(&launch), e, &mut events)),
                }
            }
            None => None,
        };
        match half.swap_in_flight(issued) {
            Some(done) => self.consume(half, done, &mut events)?,
            None if events.is_empty() && !self.live.is_empty() && !half.has_in_flight() => {
                return Err(self.fail_stalled(half));
            }
            None => {}
        }
        Ok(events)
    }

    fn set_overlap<H: Half>(&mut self, half: &mut H, on: bool) -> Result<()> {
        if on {
            return half.start_overlap();
        }
        if let Some(done) = half.stop_overlap() {
            let mut events = std::mem::take(&mut self.pending);
            let r = self.consume(half, done, &mut events);
            self.pending.extend(events);
            r?;
        }
        Ok(())
    }

    /// Waits for a launch's results, hands them to the scheduler and turns its tokens into
    /// events.
    fn consume<H: Half>(&mut self, half: &mut H, done: Issued<H::Launch, H::Pending>, events: &mut Vec<Event>) -> Result<()> {
        let started = Instant::now();
        let result = match half.collect(done.pending) {
            Ok(r) => r,
            Err(e) => return Err(self.fail_launch(half, &H::launch_requests(&done.launch), e, events)),
        };
        let wait = started.elapsed();
        let (stage, rows, tokens) = H::shape(&done.launch);
        self.metrics.record(stage, rows, tokens, done.host + wait, wait, half.cost(&done.launch));
        let _launch = tracing::debug_span!("launch", stage, rows, tokens).entered();
        tracing::trace!(host_us = done.host.as_micros() as u64, wait_us = wait.as_micros() as u64, "results in");
        let Completed { tokens, non_finite } = half.complete(&mut self.requests, &done.launch, result, &mut self.metrics);
        tracing::trace!(new_tokens = tokens.len(), "completed");
        for new in tokens {
            // Tokens of a request that finished (eos, stop, length) or was aborted are dropped.
            if let Some(ev) = self.on_token(half, new) {
                events.extend(ev);
            }
        }
        for id in non_finite {
            tracing::warn!(request = id.0, "non-finite logits");
            if let Some(mut live) = self.retire(half, id) {
                let reason = FinishReason::Error("the model produced non-finite logits (NaN or infinity) for this request".into());
                events.push(Event::Finished { id, reason, text: live.detok.flush() });
            }
        }
        self.metrics.preemptions = self.requests.preemptions();
        Ok(())
    }

    /// A device error fails every request of the launch; the error is returned too. A failed
    /// launch that names no live request (an empty or stale one from a broken scheduler) would
    /// come again and again while the live requests wait: as a stall, it fails all of them.
    fn fail_launch<H: Half>(&mut self, half: &mut H, requests: &[RequestId], e: Error, events: &mut Vec<Event>) -> Error {
        let msg = e.to_string();
        let mut everyone: Vec<RequestId> = Vec::new();
        let requests = if requests.iter().any(|id| self.live.contains_key(id)) {
            requests
        } else {
            everyone.extend(self.live.keys().copied());
            everyone.sort_by_key(|id| id.0);
            &everyone
        };
        for &id in requests {
            if self.retire(half, id).is_some() {
                events.push(Event::Finished { id, reason: FinishReason::Error(msg.clone()), text: String::new() });
            }
        }
        self.pending = std::mem::take(events);
        e
    }

    /// Ends a live request's life in the engine: out of `live`, its KV freed, its scheduler
    /// told.
    fn retire<H: Half>(&mut self, half: &mut H, id: RequestId) -> Option<Live> {
        let live = self.live.remove(&id)?;
        self.requests.end(id);
        half.finished(id);
        Some(live)
    }

    /// The scheduler has live requests but nothing to launch and nothing in flight: no later
    /// step would change that, so every live request fails (its KV is freed, its
    /// `Finished { Error }` event comes with the next step) and the error is returned.
    fn fail_stalled<H: Half>(&mut self, half: &mut H) -> Error {
        let err = Error::SchedulerStalled { scheduler: half.scheduler_name().into(), unfinished: self.live.len() };
        let msg = err.to_string();
        let mut ids: Vec<RequestId> = self.live.keys().copied().collect();
        ids.sort_by_key(|id| id.0);
        for id in ids {
            let mut live = self.retire(half, id).expect("listed");
            self.pending.push(Event::Finished { id, reason: FinishReason::Error(msg.clone()), text: live.detok.flush() });
        }
        err
    }

    fn on_token<H: Half>(&mut self, half: &mut H, (id, token, logprob, compute): NewToken) -> Option<Vec<Event>> {
        let live = self.live.get_mut(&id)?;
        let mut events = Vec::with_capacity(2);
        let finish = if !live.params.ignore_eos && self.eos.contains(&token) {
            Some(FinishReason::Eos)
        } else {
            live.generated.push(token);
            self.metrics.generated_tokens += 1;
            let now = Instant::now();
            match live.last_token.replace(now) {
                None => self.metrics.time_to_first_token.record(now - live.arrived),
                Some(last) => self.metrics.inter_token_latency.record(now - last),
            }
            match live.detok.push(token, self.tokenizer.as_ref(), &live.params.stop) {
                Pushed::Text(text) => {
                    events.push(Event::Token { id, token, text, logprob, compute });
                    (live.generated.len() >= live.params.max_new_tokens).then_some(FinishReason::Length)
                }
                Pushed::Stopped { text, stop } => {
                    events.push(Event::Token { id, token, text, logprob, compute });
                    Some(FinishReason::Stop(stop))
                }
                Pushed::Failed(e) => Some(FinishReason::Error(format!("detokenizing the output: {e}"))),
            }
        };
        if let Some(reason) = finish {
            let mut live = self.retire(half, id).expect("present");
            self.metrics.finished_requests += 1;
            tracing::debug!(request = id.0, tokens = live.generated.len(), reason = ?reason, "finished");
            events.push(Event::Finished { id, reason, text: live.detok.flush() });
        }
        Some(events)
    }
}

/// `text` under the model's tokenizer, which adds no special tokens (a chat template writes
/// its own, as `apply_chat_template` encodes).
fn encode_text(tokenizer: Option<&Tokenizer>, text: &str) -> Result<Vec<u32>> {
    let tok = tokenizer.ok_or_else(|| Error::Tokenizer("model has no tokenizer.json".into()))?;
    crate::tokenizer::encode(tok, text)
}

fn render_chat(template: Option<&ChatTemplate>, chat: &Chat) -> Result<String> {
    let template = template.ok_or_else(|| Error::ChatTemplate("the model has no chat template (tokenizer_config.json / chat_template.jinja)".into()))?;
    template.render(chat)
}

/// A prompt's token ids: ids as given, text encoded, a conversation rendered through the chat
/// template then encoded. The engine does this on admission; [`super::EngineHandle::submit`]
/// does it on the caller's thread first, so that a long prompt or a slow template never holds
/// the engine thread (and the steps of every other request) up.
pub(super) fn prompt_ids(tokenizer: Option<&Tokenizer>, chat: Option<&ChatTemplate>, prompt: Prompt) -> Result<Vec<u32>> {
    match prompt {
        Prompt::Ids(ids) => Ok(ids),
        Prompt::Text(t) => encode_text(tokenizer, &t),
        Prompt::Chat(c) => encode_text(tokenizer, &render_chat(chat, &c)?),
    }
}
