//! Continuous depth batching (CDB): scheduling at the granularity of one loop iteration.
//!
//! Work items are (request, token, position, loop step, gate state). Each tick launches one
//! homogeneous stage, by priority: coda (when `min_coda_batch_size` exited items wait) →
//! prefill (full depth; admitted while a resident slot and the request's worst-case KV are
//! free) → recurrent core step (rows at *different* loop steps in one launch) → flush of a
//! small coda batch. Survivors and successors go to the head of the recurrent queue; a new
//! request's first item goes to the tail.
//!
//! - **refill**: every core launch takes up to `max_num_seqs` ready items, so rows freed by
//!   exits are refilled by successors as soon as the coda has run.
//! - **no-refill**: lock-step waves. All resident requests start a token together; each core
//!   launch holds only the items that have not exited (the batch shrinks); one coda runs over the
//!   whole cohort when the last item exits; prefill admission happens between waves.
//!
//! Coda and prefill launches re-enter eagerly: the runner embeds each sampled token into the
//! state bank as its successor's step-0 state in the same launch. If that token turns out to be
//! a stop token, the engine finishes the request and the queued successor is dropped.
//!
//! Prefill is chunked: a prefill launch holds at most `max_num_batched_tokens` prompt tokens,
//! first the next chunks of partly prefilled prompts, then the first chunks of newly admitted
//! requests; each chunk runs at full depth through the layout's slots and only a prompt's last
//! chunk samples. While items wait for a core step or a coda, a prefill launch is followed by a
//! decode launch, so no decode waits longer than one chunk.
//!
//! KV is reserved for the worst case (prompt + `max_new_tokens`) at admission, so a running
//! request never stalls on KV.

use super::admission::{admits_prefill, prefill_chunk, prefills_whole_prompts};
use super::layout::KvLayout;
use super::{KvCopy, LoopedLaunch, LoopedResult, LoopedRow, LoopedScheduler, Stage};
use crate::looped::gate::{ExitGate, GateState, ItemRef, StepSignals};
use crate::request::RequestId;
use crate::scheduler::{Requests, SchedRequest, SchedulerLimits};
use std::collections::{HashMap, VecDeque};

/// Options of the depth scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct DepthConfig {
    pub refill: bool,
    /// Hold the coda until this many exited items wait (amortises a heavy coda); flushed when
    /// nothing else can run, so it never deadlocks.
    pub min_coda_batch_size: usize,
    /// While requests are decoding, admit a prefill only once this many resident slots are
    /// free (or every waiting request fits): one prefill of many prompts instead of a
    /// full-depth prefill launch per finished request. `None`: `max(1, max_num_seqs / 16)`.
    pub min_free_slots: Option<usize>,
    /// Resident requests allowed beyond `max_num_seqs`; launches still hold at most
    /// `max_num_seqs` rows. Exited items waiting for a held coda (up to
    /// `min_coda_batch_size − 1`) keep their resident slots but are not in the core launch; a
    /// reserve of that many keeps the core launch full meanwhile, at the KV cost of as many more
    /// requests. 0 (default): `max_num_seqs` caps resident requests, as in the paper. Refill only.
    /// (A request whose last token's coda has been issued gives its slot and KV back then,
    /// while it waits for that token.)
    pub coda_reserve: usize,
}

impl Default for DepthConfig {
    fn default() -> Self {
        Self { refill: true, min_coda_batch_size: 1, min_free_slots: None, coda_reserve: 0 }
    }
}

impl DepthConfig {
    /// Resident requests at most: `max_num_seqs` plus the coda reserve (refill only: a
    /// no-refill wave is every resident request in one launch).
    pub fn max_resident(&self, max_num_seqs: usize) -> usize {
        if !self.refill {
            return max_num_seqs;
        }
        max_num_seqs + self.coda_reserve
    }
}

#[derive(Debug)]
struct Req {
    /// Prompt and the generated tokens the host has seen so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Prompt tokens whose prefill chunks have been issued.
    prefilled: usize,
    max_new: usize,
    state: u32,
    /// Tokens whose producing launch (prefill or coda) has been issued.
    launched: usize,
    /// Gate state and token index of the request's current item (one item per request at a
    /// time; its signals can arrive after the item was routed on).
    gate: GateState,
    item_token: usize,
    /// The state row and the KV blocks went back to the pools when the coda of the request's
    /// last token was issued (its result has not been read yet; `finish` must not free the row
    /// again).
    state_released: bool,
}

impl Req {
    /// Where the current item is identified to the gate: its input is the token before the one
    /// it produces, once the host has it.
    fn item_ref(&self, request: RequestId) -> ItemRef {
        let input_token = (self.prompt_len + self.item_token).checked_sub(1).and_then(|i| self.tokens.get(i).copied());
        ItemRef { request, token_index: self.item_token, input_token }
    }
}

#[derive(Debug, Clone)]
struct Item {
    request: RequestId,
    /// Index of the generated token this item produces (the prefill produced index 0).
    token_index: usize,
    pos: usize,
    /// Next loop step to run (for an item in flight: the step it is running).
    step: usize,
}

/// The CDB scheduler. See the module docs.
#[derive(Debug)]
pub struct DepthBatching {
    cfg: DepthConfig,
    limits: SchedulerLimits,
    /// Which cache slot each loop step reads and writes, and which an exit fills.
    layout: Box<dyn KvLayout>,
    gate: Box<dyn ExitGate>,
    /// The gate's step bounds, enforced on every routing (see `route_core`).
    min_steps: usize,
    max_steps: usize,
    reqs: HashMap<RequestId, Req>,
    free_states: Vec<u32>,
    ready: VecDeque<Item>,
    coda: VecDeque<Item>,
    /// Core items launched and not yet routed (their exit verdict may still be unknown).
    in_flight: HashMap<RequestId, Item>,
    /// Rows of issued launches not yet routed, in launch order.
    unrouted: VecDeque<(Stage, RequestId)>,
    copies: Vec<(RequestId, KvCopy)>,
    hist: Vec<u64>,
    /// No-refill: a wave is running (no admission, no early coda).
    wave: bool,
    /// Requests whose prompt is partly prefilled, in admission order.
    prefilling: VecDeque<RequestId>,
    /// The last launch was a prefill: a decode launch goes next if items wait for one.
    last_was_prefill: bool,
}

impl DepthBatching {
    /// Requests hold a block table per slot of `layout`; `gate` must already be checked against
    /// the layout ([`super::layout::check_layout`]).
    pub fn new(cfg: DepthConfig, limits: SchedulerLimits, layout: Box<dyn KvLayout>, gate: Box<dyn ExitGate>) -> Self {
        let (min_steps, max_steps) = (gate.min_steps(), gate.max_steps());
        let free_states = (0..cfg.max_resident(limits.max_num_seqs) as u32).rev().collect();
        Self {
            cfg,
            limits,
            layout,
            gate,
            min_steps,
            max_steps,
            reqs: HashMap::new(),
            free_states,
            ready: VecDeque::new(),
            coda: VecDeque::new(),
            in_flight: HashMap::new(),
            unrouted: VecDeque::new(),
            copies: Vec::new(),
            hist: vec![0; max_steps],
            wave: false,
            prefilling: VecDeque::new(),
            last_was_prefill: false,
        }
    }

    pub fn gate(&self) -> &dyn ExitGate {
        self.gate.as_ref()
    }

    fn launch(&mut self, stage: Stage, rows: Vec<LoopedRow>) -> LoopedLaunch {
        let kv_copies = std::mem::take(&mut self.copies).into_iter().map(|(_, c)| c).collect();
        let step_slots = match stage {
            Stage::Prefill => (0..self.max_steps).map(|s| self.layout.slot_for_step(s)).collect(),
            _ => Vec::new(),
        };
        let reenter = matches!(stage, Stage::Prefill | Stage::Coda);
        LoopedLaunch { stage, step_slots, rows, kv_copies, reenter }
    }

    fn tables(requests: &Requests, id: RequestId) -> Vec<crate::kv::BlockTable> {
        requests.tables(id).expect("resident request has KV").to_vec()
    }

    /// The row that reads an item's state (and, for coda rows, re-enters its successor).
    fn item_row(&self, requests: &Requests, item: &Item, stage: Stage) -> LoopedRow {
        let req = &self.reqs[&item.request];
        LoopedRow {
            request: item.request,
            // Core and coda rows read their state from the bank; the input token is informative
            // and, when launches overlap, may not have reached the host yet (then 0).
            tokens: vec![req.tokens.get(item.pos).copied().unwrap_or(0)],
            start_pos: item.pos,
            block_tables: Self::tables(requests, item.request),
            // Coda rows sample; the successor re-enters only if the request wants more tokens.
            sample: stage == Stage::Coda,
            step: item.step,
            slot: self.layout.slot_for_step(item.step),
            state: req.state,
        }
    }

    /// One prefill launch of at most `max_num_batched_tokens` prompt tokens (see the module
    /// docs), or `None` when a decode launch should go first or nothing can be prefilled.
    fn try_prefill(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        if self.last_was_prefill && !(self.ready.is_empty() && self.coda.is_empty()) {
            return None;
        }
        let mut rows = Vec::new();
        let mut budget = self.limits.max_num_batched_tokens;
        let mut i = 0;
        let whole = prefills_whole_prompts(self.layout.num_slots(self.max_steps), self.max_steps);
        while i < self.prefilling.len() {
            let id = self.prefilling[i];
            let req = &self.reqs[&id];
            let n = prefill_chunk(req.prompt_len - req.prefilled, budget, whole, rows.is_empty());
            if n == 0 {
                break;
            }
            let row = self.chunk_row(requests, id, n, &mut budget);
            if self.reqs[&id].prefilled == self.reqs[&id].prompt_len {
                self.prefilling.remove(i);
            } else {
                i += 1;
            }
            rows.push(row);
        }
        // Requests still prefilling do not decode yet: they do not hold admission back.
        let decoding = self.reqs.len() > self.prefilling.len();
        let admitting = admits_prefill(&self.limits, self.cfg.min_free_slots, decoding, self.free_states.len(), requests.num_waiting());
        while let Some(next) = requests.front().filter(|_| admitting) {
            let (id, need) = (next.id, next.prompt.len() + next.max_new_tokens);
            let n = prefill_chunk(next.prompt.len(), budget, whole, rows.is_empty());
            if n == 0 {
                break;
            }
            let kv = requests.kv();
            if self.free_states.is_empty() || kv.blocks_missing(id, need) > kv.num_free_blocks() {
                break;
            }
            let SchedRequest { prompt, max_new_tokens: max_new, .. } = requests.admit_front(need).expect("checked free blocks");
            let state = self.free_states.pop().expect("checked");
            let req = Req {
                prompt_len: prompt.len(),
                prefilled: 0,
                tokens: prompt,
                max_new,
                state,
                launched: 0,
                gate: GateState::new(),
                item_token: 0,
                state_released: false,
            };
            self.reqs.insert(id, req);
            let row = self.chunk_row(requests, id, n, &mut budget);
            if self.reqs[&id].prefilled < self.reqs[&id].prompt_len {
                self.prefilling.push_back(id);
            }
            rows.push(row);
        }
        (!rows.is_empty()).then(|| self.launch(Stage::Prefill, rows))
    }

    /// The next prefill chunk of `id`, `n` tokens (taken from `budget`). The prompt's last chunk
    /// samples the first token and queues the successor's routing.
    fn chunk_row(&mut self, requests: &Requests, id: RequestId, n: usize, budget: &mut usize) -> LoopedRow {
        let tables = Self::tables(requests, id);
        let req = self.reqs.get_mut(&id).expect("admitted");
        let start = req.prefilled;
        *budget -= n.min(*budget);
        req.prefilled += n;
        let last = req.prefilled == req.prompt_len;
        let mut row = LoopedRow::full_depth(id, req.tokens[start..start + n].to_vec(), start, tables);
        row.state = req.state;
        row.sample = last;
        if last {
            req.launched = 1;
            self.unrouted.push_back((Stage::Prefill, id));
        }
        row
    }

    fn take_coda(&mut self, requests: &mut Requests, all: bool) -> Option<LoopedLaunch> {
        if self.coda.is_empty() {
            return None;
        }
        let n = if all { self.coda.len() } else { self.coda.len().min(self.limits.max_num_seqs) };
        let items: Vec<Item> = self.coda.drain(..n).collect();
        let rows = items.iter().map(|it| self.item_row(requests, it, Stage::Coda)).collect();
        for it in items {
            self.unrouted.push_back((Stage::Coda, it.request));
            if let Some(req) = self.reqs.get_mut(&it.request) {
                req.launched += 1;
                // The request's last token: nothing reads its state row or its K/V after this
                // coda (its rows carry their block tables; its exit copies run in this launch),
                // so the row (its resident slot) and its KV blocks go back now. With overlap the
                // engine finishes the request only once the coda's result is read, a launch
                // later; a replacement admitted meanwhile starts in step with the coda's
                // successors instead of half a token out of phase (which costs a coda launch per
                // token from then on). Launches run in order on the device, so a prefill that
                // reuses the row or the blocks writes them after this coda has read them.
                if req.launched >= req.max_new && !req.state_released {
                    req.state_released = true;
                    self.free_states.push(req.state);
                    requests.free_kv(it.request);
                }
            }
        }
        Some(self.launch(Stage::Coda, rows))
    }

    fn take_core(&mut self, requests: &Requests) -> Option<LoopedLaunch> {
        if self.ready.is_empty() {
            return None;
        }
        let n = self.ready.len().min(self.limits.max_num_seqs);
        let items: Vec<Item> = self.ready.drain(..n).collect();
        let rows = items.iter().map(|it| self.item_row(requests, it, Stage::CoreStep)).collect();
        for it in items {
            self.unrouted.push_back((Stage::CoreStep, it.request));
            self.in_flight.insert(it.request, it);
        }
        Some(self.launch(Stage::CoreStep, rows))
    }

    /// The successor of a request whose last issued prefill/coda produces token
    /// `launched - 1`, if the request wants more tokens. Resets the request's gate state.
    fn successor(&mut self, id: RequestId) -> Option<Item> {
        let req = self.reqs.get_mut(&id)?;
        if req.launched >= req.max_new {
            return None;
        }
        req.gate = GateState::new();
        req.item_token = req.launched;
        Some(Item { request: id, token_index: req.launched, pos: req.prompt_len + req.launched - 1, step: 0 })
    }

    /// Sends an item that finished `item.step` to the coda or on to its next step.
    fn route_core(&mut self, requests: &Requests, mut item: Item, exit: bool, survivors: &mut Vec<Item>) {
        // The gate must exit within its own `min_steps..=max_steps` (the bounds the layout was
        // checked against); one that does not (a custom gate breaking the contract) is
        // overruled: an item past its slots would index out of them, and one exiting early
        // would leave slots unwritten that later tokens read.
        let exit = exit && item.step + 1 >= self.min_steps;
        if exit || item.step + 1 >= self.max_steps {
            self.hist[item.step] += 1;
            self.exit_copies(requests, &item);
            self.coda.push_back(item);
        } else {
            item.step += 1;
            survivors.push(item);
        }
    }

    /// Routes every issued row whose routing is known: successors of prefill and coda rows
    /// (their tokens need not have reached the host: the state was re-entered on the device),
    /// and core items whose verdict the gate knows ahead of their own signal. Survivors and
    /// coda successors go to the head of the ready queue, a prompt's first item to the tail.
    fn route(&mut self, requests: &Requests) {
        let mut front = Vec::new();
        let mut keep = VecDeque::new();
        while let Some((stage, id)) = self.unrouted.pop_front() {
            match stage {
                Stage::Prefill => {
                    if let Some(it) = self.successor(id) {
                        self.ready.push_back(it);
                    }
                }
                Stage::Coda => front.extend(self.successor(id)),
                Stage::CoreStep => {
                    let Some(item) = self.in_flight.get(&id) else {
                        continue;
                    };
                    debug_assert_eq!(self.reqs.get(&id).map(|r| r.item_token), Some(item.token_index));
                    match self.reqs.get(&id).and_then(|r| self.gate.exit_known(r.item_ref(id), item.step, &r.gate)) {
                        Some(exit) => {
                            let item = self.in_flight.remove(&id).expect("present");
                            self.route_core(requests, item, exit, &mut front);
                        }
                        None => keep.push_back((stage, id)),
                    }
                }
                Stage::FullDepthDecode => {}
            }
        }
        self.unrouted = keep;
        for it in front.into_iter().rev() {
            self.ready.push_front(it);
        }
    }

    fn exit_copies(&mut self, requests: &Requests, item: &Item) {
        let kv = requests.kv();
        let layout = self.layout.as_ref();
        let fill = layout.fill_on_exit(item.step, self.max_steps);
        if fill.is_empty() {
            return;
        }
        let bs = kv.block_size() as u32;
        let tables = kv.tables(item.request).expect("resident");
        let flat = |slot: usize| tables[slot][item.pos / bs as usize] * bs + (item.pos % bs as usize) as u32;
        let src = flat(layout.slot_for_step(item.step));
        let copies: Vec<_> = fill.into_iter().map(|s| (item.request, KvCopy { src, dst: flat(s) })).collect();
        self.copies.extend(copies);
    }
}

impl LoopedScheduler for DepthBatching {
    fn name(&self) -> &'static str {
        if self.cfg.refill {
            "cdb-refill"
        } else {
            "cdb-no-refill"
        }
    }

    fn schedule(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        let launch = self.next_launch(requests);
        self.last_was_prefill = launch.as_ref().is_some_and(|l| l.stage == Stage::Prefill);
        launch
    }

    fn complete(&mut self, requests: &mut Requests, launch: &LoopedLaunch, result: &LoopedResult) {
        self.record(requests, launch, result);
    }

    fn finished(&mut self, id: RequestId) {
        self.prefilling.retain(|&r| r != id);
        self.ready.retain(|it| it.request != id);
        self.coda.retain(|it| it.request != id);
        self.in_flight.remove(&id);
        self.unrouted.retain(|(_, r)| *r != id);
        // Copies into a finished request's blocks must not land after the blocks are reused.
        self.copies.retain(|(r, _)| *r != id);
        if let Some(req) = self.reqs.remove(&id).filter(|r| !r.state_released) {
            self.free_states.push(req.state);
        }
    }

    fn depth_histogram(&self) -> &[u64] {
        &self.hist
    }

    fn state_bank_rows(&self) -> usize {
        self.cfg.max_resident(self.limits.max_num_seqs)
    }

    fn supports_overlap(&self) -> bool {
        // Asked with the input token known: by the time a step's verdict is routed, the token
        // sampled for the item one launch earlier has been read back.
        let probe = ItemRef { request: RequestId(0), token_index: 0, input_token: Some(0) };
        self.gate.exit_known(probe, 0, &GateState::new()).is_some()
    }
}

impl DepthBatching {
    fn next_launch(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        self.route(requests);
        if self.cfg.refill {
            if self.coda.len() >= self.cfg.min_coda_batch_size.max(1) {
                return self.take_coda(requests, false);
            }
            if let Some(l) = self.try_prefill(requests) {
                return Some(l);
            }
            return self.take_core(requests).or_else(|| self.take_coda(requests, false));
        }
        // No-refill: one wave to completion (its coda over the whole cohort), then prefill
        // admission between waves, then the next wave.
        if self.wave {
            if let Some(l) = self.take_core(requests) {
                return Some(l);
            }
            self.wave = false;
            if let Some(l) = self.take_coda(requests, true) {
                return Some(l);
            }
        }
        if let Some(l) = self.try_prefill(requests) {
            return Some(l);
        }
        if self.ready.is_empty() {
            return self.take_coda(requests, true);
        }
        self.wave = true;
        self.take_core(requests)
    }

    fn record(&mut self, requests: &Requests, launch: &LoopedLaunch, result: &LoopedResult) {
        match launch.stage {
            Stage::Prefill | Stage::Coda => {
                for (row, out) in launch.rows.iter().zip(&result.rows) {
                    let (Some(req), Some(t)) = (self.reqs.get_mut(&row.request), out.token) else {
                        continue;
                    };
                    req.tokens.push(t);
                    if launch.stage == Stage::Prefill {
                        self.hist[self.max_steps - 1] += 1; // first tokens run full depth
                    }
                }
            }
            Stage::CoreStep => {
                let mut survivors = Vec::new();
                let mut routed = std::collections::HashSet::new();
                for (row, out) in launch.rows.iter().zip(&result.rows) {
                    let Some(req) = self.reqs.get_mut(&row.request) else {
                        continue;
                    };
                    let signals = StepSignals { logit: out.gate_logits.last().copied(), latent_diff: out.latent_diff };
                    // The item of this row, if it is still waiting for its verdict; otherwise it
                    // was routed ahead (the gate knew its verdict) and the signal only advances
                    // the gate state.
                    let pending = self.in_flight.get(&row.request).filter(|it| it.step == row.step).is_some();
                    let at = req.item_ref(row.request);
                    let exit = self.gate.decide(at, row.step, signals, &mut req.gate);
                    if pending {
                        let item = self.in_flight.remove(&row.request).expect("pending");
                        routed.insert(row.request);
                        self.route_core(requests, item, exit, &mut survivors);
                    }
                }
                if !routed.is_empty() {
                    self.unrouted.retain(|(s, id)| !(*s == Stage::CoreStep && routed.contains(id)));
                }
                for it in survivors.into_iter().rev() {
                    self.ready.push_front(it);
                }
            }
            Stage::FullDepthDecode => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvManager;
    use crate::looped::driven::Driven;
    use crate::looped::gate::{DepthTrace, FixedDepth, Replay};
    use crate::looped::layout::{KvLayout, LastExited, Shared};
    use crate::looped::LoopedRowOutput;

    fn sched(refill: bool, width: usize, gate: Box<dyn ExitGate>) -> Driven<DepthBatching> {
        let limits = SchedulerLimits { max_num_seqs: width, max_num_batched_tokens: 4096 };
        let kv = KvManager::new(4096, 4, Shared.num_slots(4));
        Driven::new(DepthBatching::new(DepthConfig { refill, min_coda_batch_size: 1, ..DepthConfig::default() }, limits, Box::new(Shared), gate), kv)
    }

    fn replay() -> Box<dyn ExitGate> {
        Box::new(Replay::new(DepthTrace::with_mean(2.5, 1, 4, 9).unwrap(), 1, 4).unwrap())
    }

    /// Runs the scheduler with a fake model (every sampled token is 1) and returns its launches.
    fn drive(s: &mut Driven<DepthBatching>, requests: usize, new_tokens: usize) -> Vec<LoopedLaunch> {
        drive_lengths(s, &vec![new_tokens; requests], false)
    }

    /// [`drive`] with a length per request; with `overlap` as the engine drives an overlapping
    /// scheduler: launch k + 1 is scheduled before launch k's result is read (and before the
    /// requests it finished are finished).
    fn drive_lengths(s: &mut Driven<DepthBatching>, new_tokens: &[usize], overlap: bool) -> Vec<LoopedLaunch> {
        for (i, &n) in new_tokens.iter().enumerate() {
            s.add(SchedRequest { id: RequestId(i as u64), prompt: vec![3; 5], max_new_tokens: n });
        }
        let mut produced = vec![0usize; new_tokens.len()];
        let (mut launches, mut pending) = (Vec::new(), None::<LoopedLaunch>);
        loop {
            let next = s.schedule();
            if !overlap {
                let Some(l) = next else { break };
                launches.push(complete(s, l, new_tokens, &mut produced));
            } else {
                let had = pending.is_some();
                if let Some(l) = pending.take() {
                    launches.push(complete(s, l, new_tokens, &mut produced));
                }
                match next {
                    Some(l) => pending = Some(l),
                    None if !had => break,
                    None => {}
                }
            }
            assert!(launches.len() < 100_000, "scheduler does not terminate");
        }
        assert_eq!(produced, new_tokens, "every request got all its tokens");
        assert_eq!(s.kv().num_used_blocks(), 0);
        launches
    }

    /// Completes `l` with the fake model's tokens and finishes the requests that got them all.
    fn complete(s: &mut Driven<DepthBatching>, l: LoopedLaunch, new_tokens: &[usize], produced: &mut [usize]) -> LoopedLaunch {
        let rows = l.rows.iter().map(|r| LoopedRowOutput { token: r.sample.then_some(1), ..LoopedRowOutput::new(r.request) }).collect();
        let result = LoopedResult { rows, ..Default::default() };
        s.complete(&l, &result);
        for r in result.rows.iter().filter(|r| r.token.is_some()) {
            let i = r.request.0 as usize;
            produced[i] += 1;
            if produced[i] == new_tokens[i] {
                s.finish(r.request);
            }
        }
        l
    }

    #[test]
    fn a_finished_requests_slot_is_reused_in_step_with_the_cohort_under_overlap() {
        // Every token runs two steps; requests end at staggered lengths and are replaced. Under
        // overlap the engine finishes a request a launch after its last coda was issued; the
        // replacement must still start in step with the other requests' successors, or every
        // later token costs a coda launch of its own.
        let new_tokens: Vec<usize> = (0..12).map(|i| 5 + (i * 7) % 11).collect();
        let count = |launches: &[LoopedLaunch], stage| launches.iter().filter(|l| l.stage == stage).count();
        // A roomy KV pool, and one that holds exactly four of the longest requests (5 + 15
        // positions in blocks of 4): the replacement needs the finished request's KV too.
        for blocks in [4096, 4 * 5] {
            let make = || {
                let limits = SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 4096 };
                let kv = KvManager::new(blocks, 4, Shared.num_slots(4));
                Driven::new(DepthBatching::new(DepthConfig::default(), limits, Box::new(Shared), Box::new(FixedDepth::new(2).unwrap())), kv)
            };
            let mut sync = make();
            let sync_launches = drive_lengths(&mut sync, &new_tokens, false);
            let mut ahead = make();
            let ahead_launches = drive_lengths(&mut ahead, &new_tokens, true);
            assert_eq!(count(&ahead_launches, Stage::Coda), count(&sync_launches, Stage::Coda), "{blocks} blocks: overlap splits no coda");
            assert_eq!(count(&ahead_launches, Stage::CoreStep), count(&sync_launches, Stage::CoreStep), "{blocks} blocks");
            // Every state row is back exactly once.
            for s in [&sync, &ahead] {
                let mut rows = s.s.free_states.clone();
                rows.sort_unstable();
                assert_eq!(rows, (0..4).collect::<Vec<u32>>());
            }
        }
    }

    #[test]
    fn refill_keeps_the_core_batch_full() {
        let (w, n) = (4, 40);
        let mut s = sched(true, w, replay());
        let launches = drive(&mut s, w, n);
        let cores: Vec<&LoopedLaunch> = launches.iter().filter(|l| l.stage == Stage::CoreStep).collect();
        // While all W requests are far from their end, every core launch is full.
        let steady = &cores[2..cores.len() * 3 / 4];
        assert!(steady.iter().all(|l| l.rows.len() == w), "refill stopped refilling: {:?}", steady.iter().map(|l| l.rows.len()).collect::<Vec<_>>());
        assert!(cores.iter().any(|l| l.rows.iter().any(|r| r.step != l.rows[0].step)), "refill mixes loop steps in a launch");
        let h = s.s.depth_histogram().to_vec();
        assert_eq!(h.iter().sum::<u64>(), (w * n) as u64);
    }

    /// Core launches while every request is far from its end, under a held coda of 3.
    fn steady_core_rows(reserve: usize) -> Vec<usize> {
        let (w, n) = (4, 40);
        let limits = SchedulerLimits { max_num_seqs: w, max_num_batched_tokens: 4096 };
        let kv = KvManager::new(4096, 4, Shared.num_slots(4));
        let cfg = DepthConfig { min_coda_batch_size: 3, coda_reserve: reserve, ..DepthConfig::default() };
        let mut s = Driven::new(DepthBatching::new(cfg, limits, Box::new(Shared), replay()), kv);
        assert_eq!(s.s.state_bank_rows(), w + reserve);
        let launches = drive(&mut s, w + reserve, n);
        assert!(launches.iter().filter(|l| l.stage != Stage::Prefill).all(|l| l.rows.len() <= w), "a decode launch exceeded the width");
        let cores: Vec<usize> = launches.iter().filter(|l| l.stage == Stage::CoreStep).map(|l| l.rows.len()).collect();
        cores[2..cores.len() / 2].to_vec()
    }

    #[test]
    fn coda_reserve_keeps_the_core_launch_full_while_the_coda_is_held() {
        // Without a reserve, items parked for the coda leave core launches short.
        assert!(steady_core_rows(0).iter().any(|&r| r < 4));
        let full = steady_core_rows(2);
        assert!(full.iter().all(|&r| r == 4), "core rows with a reserve of 2: {full:?}");
    }

    #[test]
    fn no_refill_runs_shrinking_lock_step_waves() {
        let (w, n) = (4, 30);
        let mut s = sched(false, w, replay());
        let launches = drive(&mut s, w, n);
        let mut prev: Option<&LoopedLaunch> = None;
        for l in &launches {
            if l.stage == Stage::CoreStep {
                let step = l.rows[0].step;
                assert!(l.rows.iter().all(|r| r.step == step), "no-refill launch mixes steps (it refilled)");
                if let Some(p) = prev.filter(|p| p.stage == Stage::CoreStep) {
                    assert_eq!(step, p.rows[0].step + 1, "a wave advances one step per launch");
                    assert!(l.rows.len() <= p.rows.len(), "a wave's batch never grows");
                } else {
                    assert_eq!(step, 0, "a wave starts at step 0");
                }
            }
            prev = Some(l);
        }
    }

    #[test]
    fn last_exited_copies_exit_kv_into_deeper_slots() {
        let limits = SchedulerLimits { max_num_seqs: 1, max_num_batched_tokens: 64 };
        let kv = KvManager::new(64, 4, LastExited.num_slots(4));
        let gate = Box::new(Replay::new(DepthTrace::Recorded([(0, vec![2])].into()), 1, 4).unwrap());
        let mut s = Driven::new(DepthBatching::new(DepthConfig::default(), limits, Box::new(LastExited), gate), kv);
        s.add(SchedRequest { id: RequestId(0), prompt: vec![1; 6], max_new_tokens: 3 });
        let answer = |l: &LoopedLaunch| LoopedResult {
            non_finite: vec![],
            rows: l.rows.iter().map(|r| LoopedRowOutput { token: r.sample.then_some(2), ..LoopedRowOutput::new(r.request) }).collect(),
        };
        let prefill = s.schedule().unwrap();
        assert_eq!(prefill.stage, Stage::Prefill);
        s.complete(&prefill, &answer(&prefill));
        for step in 0..2 {
            let core = s.schedule().unwrap();
            assert_eq!((core.stage, core.rows[0].step, core.rows[0].slot), (Stage::CoreStep, step, step));
            assert!(core.kv_copies.is_empty());
            s.complete(&core, &answer(&core));
        }
        // Exited after step 1 (depth 2): the next launch fills slots 2 and 3 at position 6.
        let coda = s.schedule().unwrap();
        assert_eq!(coda.stage, Stage::Coda);
        let t = s.kv().tables(RequestId(0)).unwrap();
        let at = |slot: usize| t[slot][1] * 4 + 2;
        assert_eq!(coda.kv_copies, vec![KvCopy { src: at(1), dst: at(2) }, KvCopy { src: at(1), dst: at(3) }]);
        s.finish(RequestId(0));
        assert_eq!(s.kv().num_used_blocks(), 0);
    }

    #[test]
    fn fixed_full_depth_never_exits_early() {
        let mut s = sched(true, 3, Box::new(FixedDepth::new(4).unwrap()));
        drive(&mut s, 5, 6);
        let h = s.s.depth_histogram().to_vec();
        assert_eq!(&h[..3], &[0, 0, 0]);
        assert_eq!(h[3], 30);
    }

    #[test]
    fn long_prompt_prefills_in_chunks_and_no_decode_waits_longer_than_one() {
        for refill in [true, false] {
            let limits = SchedulerLimits { max_num_seqs: 4, max_num_batched_tokens: 8 };
            let kv = KvManager::new(4096, 4, LastExited.num_slots(4));
            let cfg = DepthConfig { refill, min_free_slots: Some(1), ..DepthConfig::default() };
            let mut s = Driven::new(DepthBatching::new(cfg, limits, Box::new(LastExited), replay()), kv);
            for i in 0..3 {
                s.add(SchedRequest { id: RequestId(i), prompt: vec![3; 4], max_new_tokens: 30 });
            }
            let mut launches = Vec::new();
            let answer = |l: &LoopedLaunch| LoopedResult {
                non_finite: vec![],
                rows: l.rows.iter().map(|r| LoopedRowOutput { token: r.sample.then_some(1), ..LoopedRowOutput::new(r.request) }).collect(),
            };
            for _ in 0..3 {
                let l = s.schedule().unwrap();
                s.complete(&l, &answer(&l));
            }
            s.add(SchedRequest { id: RequestId(9), prompt: vec![5; 61], max_new_tokens: 2 });
            let mut prefilled = 0;
            while prefilled < 61 {
                let l = s.schedule().unwrap();
                s.complete(&l, &answer(&l));
                if l.stage == Stage::Prefill {
                    assert!(l.num_tokens() <= 8);
                    for r in l.rows.iter().filter(|r| r.request == RequestId(9)) {
                        assert_eq!(r.start_pos, prefilled, "chunks are consecutive");
                        prefilled += r.tokens.len();
                        assert_eq!(r.sample, prefilled == 61, "only the last chunk samples");
                    }
                }
                launches.push(l.stage);
            }
            assert!(launches.iter().filter(|&&st| st == Stage::Prefill).count() >= 8, "{launches:?}");
            assert!(launches.windows(2).all(|w| !(w[0] == Stage::Prefill && w[1] == Stage::Prefill)), "refill={refill}: back-to-back prefills {launches:?}");
            for i in [0, 1, 2, 9] {
                s.finish(RequestId(i));
            }
            assert_eq!(s.kv().num_used_blocks(), 0);
        }
    }
}
