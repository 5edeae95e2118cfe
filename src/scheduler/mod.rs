//! Schedulers decide what runs next; they never touch tensors.
//!
//! A scheduler holds request state and KV bookkeeping and returns a [`Launch`]: plain data
//! naming the stage, the rows, their tokens and positions and the block tables to use. The
//! engine runs it and hands back a [`LaunchResult`] of small per-row host values. A scheduler
//! is therefore testable with no model, and a researcher can write one in another crate.

mod continuous;
mod depth;
mod diffusion;

pub use continuous::ContinuousBatching;
pub use depth::{DepthBatching, DepthConfig};
pub use diffusion::{DiffusionBatching, DiffusionConfig};

use crate::engine::RequestId;
use crate::kv::{BlockTable, KvManager};

/// A request as the scheduler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
}

/// Which stage of the model a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    /// Prompt tokens through prelude + every loop step + coda of the last token (full depth).
    Prefill,
    /// One new token per row through prelude + every loop step + coda (the CB baseline).
    FullDepthDecode,
    /// One loop step for items that may sit at different steps (each row brings its slot).
    CoreStep,
    /// Exited items: the coda reads their state and a next token is sampled.
    Coda,
    /// Diffusion LMs: every layer over each row's tokens (a prompt prefill, a finished block's
    /// clean K/V write, or a denoising step over a block's recomputed positions); rows with
    /// `readout` get the greedy token and its probability at those tokens.
    Denoise,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::FullDepthDecode => "decode",
            Self::CoreStep => "core",
            Self::Coda => "coda",
            Self::Denoise => "denoise",
        }
    }
}

/// One row of a launch: one request's tokens at consecutive positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchRow {
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
    /// Cache position of each token, ascending, when they are not `start_pos..` in a run
    /// (denoising steps that recompute only part of a block). The row then sees the keys
    /// before `positions.last() + 1`. Empty: consecutive from `start_pos`.
    pub positions: Vec<u32>,
    /// Denoise launches: indices into `tokens` whose logits are read out (greedy token and its
    /// probability come back in [`RowOutput::candidates`], in this order). They are the row's
    /// masked tokens (or, for shifted-logit models, their left neighbours).
    pub readout: Vec<u32>,
    /// Denoise steps under an eviction policy: the request's block state it needs.
    pub evict: Option<EvictRow>,
}

/// What an eviction policy (FOCUS) needs of a request's step besides its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictRow {
    /// Absolute position of the block's first token.
    pub block_start: u32,
    /// Tokens decoded in this block so far and the steps that decoded at least one: ā is their
    /// ratio (1 before any).
    pub decoded: u32,
    pub decoding_steps: u32,
    /// Rightmost block offset pushed through every layer in this block (−1 at block start).
    pub block_progress: i64,
}

impl EvictRow {
    pub fn avg_decoded(&self) -> f32 {
        if self.decoding_steps == 0 {
            1.0
        } else {
            self.decoded as f32 / self.decoding_steps as f32
        }
    }
}

impl LaunchRow {
    /// A row of a full-depth launch (prefill or CB decode): no per-step addressing.
    pub fn full_depth(request: RequestId, tokens: Vec<u32>, start_pos: usize, block_tables: Vec<BlockTable>) -> Self {
        Self { request, tokens, start_pos, block_tables, sample: true, step: 0, slot: 0, state: 0, positions: Vec::new(), readout: Vec::new(), evict: None }
    }

    /// A row of a denoise launch: `tokens` at `positions` (ascending), reading out `readout`.
    pub fn denoise(request: RequestId, tokens: Vec<u32>, positions: Vec<u32>, readout: Vec<u32>, block_table: BlockTable) -> Self {
        let start_pos = positions.first().copied().unwrap_or(0) as usize;
        Self { request, tokens, start_pos, block_tables: vec![block_table], sample: false, step: 0, slot: 0, state: 0, positions, readout, evict: None }
    }

    /// Cache position of each token.
    pub fn token_positions(&self) -> Vec<u32> {
        if self.positions.is_empty() {
            (self.start_pos..self.start_pos + self.tokens.len()).map(|p| p as u32).collect()
        } else {
            self.positions.clone()
        }
    }

    /// Keys the row attends to: one past its last position.
    pub fn context_len(&self) -> usize {
        match self.positions.last() {
            Some(&p) => p as usize + 1,
            None => self.start_pos + self.tokens.len(),
        }
    }
}

/// Copy one token's K/V (every layer) from one flat cache row to another; the last-exited
/// layout fills the deeper slots of an exited token this way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCopy {
    pub src: u32,
    pub dst: u32,
}

/// One engine tick's work: a homogeneous stage over a batch of rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub stage: Stage,
    /// Cache slot of each loop step a full-depth launch runs (`step_slots.len()` steps).
    pub step_slots: Vec<usize>,
    pub rows: Vec<LaunchRow>,
    /// K/V copies to apply before the launch computes (all layers).
    pub kv_copies: Vec<KvCopy>,
    /// Prefill / coda: also run the prelude on each sampled token and store the result in the
    /// row's state-bank row, so its successor can enter the loop without a host round trip.
    pub reenter: bool,
}

impl Launch {
    pub fn num_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }
}

/// What came back for one row of a launch.
#[derive(Debug, Clone, PartialEq)]
pub struct RowOutput {
    pub request: RequestId,
    /// Sampled next token, for rows with `sample`.
    pub token: Option<u32>,
    /// Exit-gate logit of the row's last token after each loop step that ran.
    pub gate_logits: Vec<f32>,
    /// Core steps: relative latent change ‖s_r − s_{r−1}‖ / ‖s_r‖ of the row's state; `None`
    /// when the engine's exit gate does not read it (`ExitGate::reads_latent_diff`).
    pub latent_diff: Option<f32>,
    /// Teacher-forced rows: log-probability of the forced token.
    pub logprob: Option<f32>,
    /// Denoise rows: `(greedy token, its probability)` at each of the row's `readout` tokens —
    /// or, when `kept` is given and shorter, at each readout token that was kept.
    pub candidates: Vec<(u32, f32)>,
    /// Denoise rows under an eviction policy: indices into the row's `tokens` that ran past
    /// layer 1 (in shadow mode: that would have).
    pub kept: Option<Vec<u32>>,
}

impl RowOutput {
    /// A row of `request` that carries nothing yet (no token, signals or candidates).
    pub fn new(request: RequestId) -> Self {
        Self { request, token: None, gate_logits: Vec::new(), latent_diff: None, logprob: None, candidates: Vec::new(), kept: None }
    }
}

/// Host values of a finished launch, row-aligned with [`Launch::rows`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LaunchResult {
    pub rows: Vec<RowOutput>,
}

/// Limits every built-in scheduler honours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Most requests resident (decoding) at once: the decode width W.
    pub max_num_seqs: usize,
    /// Most prompt tokens in one prefill launch.
    pub max_num_batched_tokens: usize,
}

impl Default for SchedulerLimits {
    fn default() -> Self {
        Self { max_num_seqs: 64, max_num_batched_tokens: 8192 }
    }
}

impl SchedulerLimits {
    /// The full-depth prefill admission rule both looped schedulers share: while requests are
    /// decoding, admit only once `min_free_slots` resident slots are free (or every waiting
    /// request fits), so one prefill launch takes many prompts. `None`: `max(1, max_num_seqs / 16)`.
    pub fn admits_prefill(&self, min_free_slots: Option<usize>, decoding: bool, free_slots: usize, waiting: usize) -> bool {
        let min_free = min_free_slots.unwrap_or((self.max_num_seqs / 16).max(1));
        !decoding || free_slots >= min_free.min(waiting)
    }
}

/// A scheduling policy. See the module docs.
pub trait Scheduler: Send {
    fn name(&self) -> &'static str;
    /// Queues a validated request. Its prompt and `max_new_tokens` fit the KV pool.
    fn add(&mut self, request: SchedRequest);
    /// The next launch, or `None` when there is nothing to run.
    fn schedule(&mut self) -> Option<Launch>;
    /// Records the outcome of `launch` (sampled tokens extend their requests).
    fn complete(&mut self, launch: &Launch, result: &LaunchResult);
    /// Forgets a request (finished or aborted) and frees its KV blocks. Unknown ids are ignored.
    fn finish(&mut self, id: RequestId);
    fn num_waiting(&self) -> usize;
    fn num_running(&self) -> usize;
    fn kv(&self) -> &KvManager;
    /// Requests preempted so far (their KV freed and recomputed later).
    fn num_preemptions(&self) -> usize {
        0
    }
    /// `hist[d - 1]` = generated tokens that ran `d` loop steps (first tokens count at r_max).
    fn depth_histogram(&self) -> Vec<u64> {
        Vec::new()
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
    /// Tokens that became final since the last call, per request, in order (diffusion
    /// schedulers decide them in `complete`; schedulers whose tokens come straight from the
    /// launch results return none).
    fn take_emitted(&mut self) -> Vec<(RequestId, Vec<u32>)> {
        Vec::new()
    }
    /// Cache positions a request of `prompt_len` prompt tokens and `max_new_tokens` needs at
    /// most (diffusion rounds up to whole blocks).
    fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        prompt_len + max_new_tokens
    }
    /// The most tokens one prefill of this request may hold; the engine refuses a request for
    /// which that exceeds `max_num_batched_tokens`. The default counts the whole sequence, since
    /// a scheduler that preempts by recomputation (CB) re-prefills the generated tokens too.
    fn max_prefill_tokens(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        prompt_len + max_new_tokens
    }
    /// Diffusion schedulers under an eviction policy: `(tokens revealed, of them in the step's
    /// kept set)` so far — FOCUS's recall of decodable tokens in shadow mode.
    fn revealed_in_kept(&self) -> Option<(u64, u64)> {
        None
    }
}
