//! The looped family's launches: prefill, full-depth decode, one core step, coda. Rows carry
//! the loop step they run, that step's cache slot and the row of the device state bank that
//! holds the item's hidden state.

use crate::kv::BlockTable;
use crate::request::RequestId;
use crate::scheduler::Requests;

/// Which stage of a looped model a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Prompt tokens through prelude + every loop step + coda of the last token (full depth).
    Prefill,
    /// One new token per row through prelude + every loop step + coda (the CB baseline).
    FullDepthDecode,
    /// One loop step for items that may sit at different steps (each row brings its slot).
    CoreStep,
    /// Exited items: the coda reads their state and a next token is sampled.
    Coda,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::FullDepthDecode => "decode",
            Self::CoreStep => "core",
            Self::Coda => "coda",
        }
    }
}

/// One row of a looped launch: one request's tokens at consecutive positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopedRow {
    pub request: RequestId,
    /// Input token ids (the prompt for a prefill, the last sampled token for a decode).
    pub tokens: Vec<u32>,
    /// Absolute position of `tokens[0]`.
    pub start_pos: usize,
    /// The request's block tables, indexed by cache slot; each covers `start_pos + tokens.len()`.
    pub block_tables: Vec<BlockTable>,
    /// Whether the row's last token is read out and a next token sampled.
    pub sample: bool,
    /// Loop step this row runs (core-step launches).
    pub step: usize,
    /// Cache slot of that step: the row attends through `block_tables[slot]` (core steps).
    pub slot: usize,
    /// Row of the device state bank holding the item's hidden state (prelude, core, coda).
    pub state: u32,
}

impl LoopedRow {
    /// A row of a full-depth launch (prefill or CB decode): no per-step addressing.
    pub fn full_depth(request: RequestId, tokens: Vec<u32>, start_pos: usize, block_tables: Vec<BlockTable>) -> Self {
        Self { request, tokens, start_pos, block_tables, sample: true, step: 0, slot: 0, state: 0 }
    }

    /// Keys the row attends to: one past its last position.
    pub fn context_len(&self) -> usize {
        self.start_pos + self.tokens.len()
    }
}

/// Copy one token's K/V (every layer) from one flat cache row to another; the last-exited
/// layout fills the deeper slots of an exited token this way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCopy {
    pub src: u32,
    pub dst: u32,
}

/// One engine tick's work for a looped model: one stage over a batch of rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopedLaunch {
    pub stage: Stage,
    /// Cache slot of each loop step a full-depth launch runs (`step_slots.len()` steps).
    pub step_slots: Vec<usize>,
    pub rows: Vec<LoopedRow>,
    /// K/V copies to apply before the launch computes (all layers).
    pub kv_copies: Vec<KvCopy>,
    /// Prefill / coda: also run the prelude on each sampled token and store the result in the
    /// row's state-bank row, so its successor can enter the loop without a host round trip.
    pub reenter: bool,
}

impl LoopedLaunch {
    pub fn num_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }
}

/// What came back for one row of a looped launch.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopedRowOutput {
    pub request: RequestId,
    /// Sampled next token, for rows with `sample`.
    pub token: Option<u32>,
    /// Exit-gate logit of the row's last token after each loop step that ran.
    pub gate_logits: Vec<f32>,
    /// Core steps: relative latent change ‖s_r − s_{r−1}‖ / ‖s_r‖ of the row's state; `None`
    /// when the engine's exit gate does not read it (`ExitGate::reads_latent_diff`).
    pub latent_diff: Option<f32>,
    /// Teacher-forced rows and rows of requests that ask for log-probabilities: the token's.
    pub logprob: Option<crate::TokenLogprob>,
}

impl LoopedRowOutput {
    /// A row of `request` that carries nothing yet (no token, no signals).
    pub fn new(request: RequestId) -> Self {
        Self { request, token: None, gate_logits: Vec::new(), latent_diff: None, logprob: None }
    }
}

/// Host values of a finished looped launch, row-aligned with [`LoopedLaunch::rows`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoopedResult {
    pub rows: Vec<LoopedRowOutput>,
    /// Requests whose sampled row read non-finite logits (NaN or infinity): their rows carry no
    /// token, and the engine ends them with an error.
    pub non_finite: Vec<RequestId>,
}

/// A scheduling policy for looped models: `schedule`, `complete` and `finished`. The engine core
/// owns the requests and their KV ([`Requests`]) and lends them to each call; a policy keeps
/// only what it needs of its running requests.
pub trait LoopedScheduler: Send {
    /// The next launch, or `None` when there is nothing to run. Admits waiting requests,
    /// preempts and grows running ones through `requests`.
    fn schedule(&mut self, requests: &mut Requests) -> Option<LoopedLaunch>;
    /// Records the outcome of `launch` (sampled tokens extend their requests, gate signals
    /// advance the items). A request whose logits were not finite has no token here: the
    /// engine ends it (see [`LoopedResult::non_finite`]).
    fn complete(&mut self, requests: &mut Requests, launch: &LoopedLaunch, result: &LoopedResult);
    /// Forgets a request that ended (finished, aborted or failed). Its KV blocks are already
    /// free; a launch scheduled after this must not name it.
    fn finished(&mut self, id: RequestId);
    fn name(&self) -> &'static str {
        "custom"
    }
    /// `depth_histogram()[d - 1]`: generated tokens that ran `d` loop steps, for a policy that
    /// counts them (the depth scheduler; first tokens count at r_max).
    fn depth_histogram(&self) -> &[u64] {
        &[]
    }
    /// Rows of the device state bank this scheduler addresses (0 if it uses none).
    fn state_bank_rows(&self) -> usize {
        0
    }
    /// Whether `schedule` may be called once more before the previous launch's `complete`:
    /// the next launch then does not depend on the results of the one still running, so the
    /// host can build it while the device works.
    fn supports_overlap(&self) -> bool {
        false
    }
}
